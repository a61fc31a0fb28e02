"""Handles SentencePiece subwords: trains the joint model on a sample of a corpus, encodes
sentences to ids and back, and samples segmentations (subword regularization)."""

import hashlib
import itertools
import json
import os
import shutil

import numpy as np
import sentencepiece

from kyu_transformer import filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, UNK_ID, cut_at_end
from kyu_transformer.data.prepared import IdColumn
from kyu_transformer.data.text import DataError
from kyu_transformer.safety.writes import staging_beside


class Subwords:
    """Wraps the joint SentencePiece model at `model_path` (DataError if there is none), whose
    ids are 0 pad, 1 unk, 2 BOS, 3 EOS (see `train_or_load`)."""

    def __init__(self, model_path):
        if not os.path.isfile(model_path):
            raise DataError(f"{model_path}: no subword model")
        self.path = model_path
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_path)

    @classmethod
    def from_serialized(cls, model):
        """Returns the subword model of the bytes `model` (`serialized`), kept in memory: its
        `path` is None."""
        subwords = cls.__new__(cls)
        subwords.path = None
        subwords.processor = sentencepiece.SentencePieceProcessor(model_proto=model)
        return subwords

    def serialized(self):
        """Returns the model as bytes, as its file holds it."""
        return self.processor.serialized_model_proto()

    @property
    def vocab_size(self):
        """Returns the number of pieces (ids) of the model."""
        return self.processor.get_piece_size()

    def digest(self):
        """Returns the SHA-256 (hex) of the model's pieces and scores, which tell how it
        segments: equal for two models trained alike in different folders (the model file also
        holds the path it was trained in)."""
        pieces = [(self.processor.id_to_piece(i), self.processor.get_score(i))
                  for i in range(self.vocab_size)]
        return hashlib.sha256(json.dumps(pieces).encode("utf-8")).hexdigest()

    @classmethod
    def train_or_load(cls, directory, sentences, vocab_size, model_type="unigram"):
        """Returns the model in `directory`, training it on `sentences` (an iterable, read only
        then) first only when there is none."""
        path = os.path.join(directory, filenames.SUBWORDS)
        if os.path.isfile(path):
            return cls(path)
        staging = staging_beside(path, "train")
        try:
            prefix = os.path.join(staging, filenames.SUBWORDS_PREFIX)
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_prefix=prefix, vocab_size=vocab_size,
                model_type=model_type, character_coverage=1.0, hard_vocab_limit=False,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                num_threads=2, minloglevel=2)
            # The .vocab first, the .model last: a model file only ever stands complete.
            os.replace(prefix + ".vocab", os.path.join(directory, filenames.SUBWORDS_VOCABULARY))
            os.replace(prefix + ".model", path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return cls(path)

    def encode(self, sentences):
        """Encodes `sentences` to lists of ids."""
        return self.processor.encode(list(sentences), out_type=int)

    def decode(self, ids):
        """Decodes ids back to detokenized text, stopping at EOS and skipping pad and BOS."""
        return self.processor.decode([i for i in cut_at_end(ids) if i != BOS_ID])


# SentencePiece learns its pieces from this many training sentences at most (both sides), a
# sample drawn evenly from the whole corpus: enough for a vocabulary of tens of thousands of
# pieces, and Multi30k's 58,000 sentences are all taken.
SUBWORD_SAMPLE_SENTENCES = 1_000_000


def sample_pairs(pairs, size, seed):
    """Returns ``sources + targets`` of a uniform sample of at most `size` of `pairs` (an
    iterable of ``(source, target)``, read once), drawn with `seed`, in the corpus's order: all
    of them where there are no more. Each pair gets a random key and the `size` smallest keys
    are kept, so that memory holds the sample and one chunk of pairs."""
    rng, keys, kept, pairs = np.random.default_rng(seed), np.empty(0), [], iter(pairs)
    while chunk := list(itertools.islice(pairs, 65536)):
        keys, kept = np.concatenate([keys, rng.random(len(chunk))]), kept + chunk
        if len(kept) > size:
            best = np.sort(np.argpartition(keys, size - 1)[:size])  # in the corpus's order
            keys, kept = keys[best], [kept[index] for index in best]
    return [source for source, _ in kept] + [target for _, target in kept]


class SegmentationSampler:
    """Samples segmentations for subword regularization (Kudo 2018, l-best sampling):
    `draw(seed)` picks one of each sentence's `nbest` best segmentations, `x` with probability
    ~ ``p(x)^alpha``, from NumPy's generator of `seed`, so that, unlike SentencePiece's own
    sampling, a resumed run draws the same."""

    def __init__(self, subwords, sentences, alpha, nbest=16):
        self.alpha, pieces, lengths, counts = float(alpha), [], [], []
        processor, sentences = subwords.processor, list(sentences)
        for begin in range(0, len(sentences), 512):  # in chunks: n-best lists are large
            nbests = processor.nbest_encode(sentences[begin:begin + 512], nbest_size=nbest,
                                            out_type=int)
            candidates = [ids for nbest_ids in nbests for ids in nbest_ids]
            pieces.append(np.fromiter(itertools.chain.from_iterable(candidates), np.int32))
            lengths.extend(map(len, candidates))
            counts.extend(map(len, nbests))
        self.pieces = np.concatenate(pieces)  # every candidate's ids, one after another
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # (candidates + 1,)
        self.first = np.concatenate([[0], np.cumsum(counts)])  # (sentences + 1,)
        self.scores = self._log_probabilities(processor, np.array(lengths))  # (candidates,)

    def _log_probabilities(self, processor, lengths):
        """Returns each candidate's log p(x), the unigram model's: the sum of its pieces'
        scores, as SentencePiece's n-best search sums them for a model of `Subwords.train_or_load`
        (no user-defined symbols, which it scores otherwise). It scores an unknown character
        apart; every candidate of a sentence holds the same ones, so a draw among them does not
        see it."""
        piece_scores = np.array([processor.get_score(i) for i in range(len(processor))])
        candidate_of_piece = np.repeat(np.arange(len(lengths)), lengths)  # (pieces,)
        return np.bincount(candidate_of_piece, weights=piece_scores[self.pieces],
                           minlength=len(lengths))

    def candidates(self, sentence):
        """Returns the segmentations (lists of ids) of sentence number `sentence`, the best
        first."""
        return [self._ids(index) for index in range(*self.first[sentence:sentence + 2])]

    def draw(self, seed):
        """Draws one segmentation per sentence with `seed` (an int or ints); returns them as an
        `IdColumn`, a row a sentence."""
        gumbel = np.random.default_rng(seed).gumbel(size=len(self.scores))
        keys = self.alpha * self.scores + gumbel  # argmax of a segment: a draw of its softmax
        sentence_of = np.repeat(np.arange(len(self.first) - 1), np.diff(self.first))
        best = np.maximum.reduceat(keys, self.first[:-1])  # (sentences,)
        winners = np.flatnonzero(keys == best[sentence_of])
        _, first_winner = np.unique(sentence_of[winners], return_index=True)
        chosen = winners[first_winner]  # (sentences,) a candidate each
        return IdColumn(self.pieces, self.starts[chosen], self.starts[chosen + 1])

    def _ids(self, index):
        return self.pieces[self.starts[index]:self.starts[index + 1]].tolist()
