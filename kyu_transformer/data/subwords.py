"""Handles SentencePiece subwords: trains the joint model on a corpus, encodes sentences to ids
and back, samples segmentations (subword regularization) and puts the BOS/EOS markers around
ids."""

import itertools
import os
import shutil

import numpy as np
import sentencepiece

from kyu_transformer import filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, UNK_ID, cut_at_end
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

    @property
    def vocab_size(self):
        """Returns the number of pieces (ids) of the model."""
        return self.processor.get_piece_size()

    @classmethod
    def train_or_load(cls, directory, sentences, vocab_size, model_type="unigram"):
        """Returns the model in `directory`, training it on `sentences` first only when there
        is none."""
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
        """Draws one segmentation (a list of ids) per sentence with `seed` (an int or ints)."""
        gumbel = np.random.default_rng(seed).gumbel(size=len(self.scores))
        keys = self.alpha * self.scores + gumbel  # argmax of a segment: a draw of its softmax
        sentence_of = np.repeat(np.arange(len(self.first) - 1), np.diff(self.first))
        best = np.maximum.reduceat(keys, self.first[:-1])  # (sentences,)
        winners = np.flatnonzero(keys == best[sentence_of])
        _, first_winner = np.unique(sentence_of[winners], return_index=True)
        return [self._ids(index) for index in winners[first_winner]]

    def _ids(self, index):
        return self.pieces[self.starts[index]:self.starts[index + 1]].tolist()


def add_markers(source_ids, target_ids, maxlen1, maxlen2):
    """Puts the markers around ids: returns ``(sources + EOS, BOS + targets, targets + EOS,
    num_dropped)``, the pairs too long for `maxlen1` or `maxlen2` dropped."""
    kept = [(s, t) for s, t in zip(source_ids, target_ids)
            if len(s) + 1 <= maxlen1 and len(t) + 1 <= maxlen2]
    return ([[*s, EOS_ID] for s, _ in kept], [[BOS_ID, *t] for _, t in kept],
            [[*t, EOS_ID] for _, t in kept], len(source_ids) - len(kept))
