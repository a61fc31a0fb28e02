"""Makes a parallel corpus ready for training: the subword model, the training split prepared
once on disk, the epochs' batches read from it, the validation split as text."""

import os

from kyu_transformer import filenames
from kyu_transformer.data import pipeline
from kyu_transformer.data.prepared import IdColumn, PreparedSplit
from kyu_transformer.data.subwords import (
    SUBWORD_SAMPLE_SENTENCES, SegmentationSampler, Subwords, sample_pairs)
from kyu_transformer.data.text import (
    DataError, check_data_dir, fingerprint, iter_parallel, load_split, read_parallel,
    split_files)

# `subword_alpha` holds the best segmentations of every training sentence in memory (about 2 KB
# a pair): a corpus of more pairs is refused.
SAMPLED_SEGMENTATION_PAIRS = 500_000


class Corpus:
    """Holds the splits of corpus folder `data_dir`: the training split prepared as subword ids
    on disk (`PreparedSplit`, in hparam `corpus_cache`, else ``<model_dir>/prepared``), the
    validation split as text. The subword model lives in `model_dir` (the logdir), trained on a
    sample of the training split the first time. `log` receives the reports, the unknown pieces
    among them (a fine-tuning run's subword model may lack characters)."""

    def __init__(self, data_dir, model_dir, hparams, log=print):
        self.hparams, self.maxlens = hparams, (hparams["maxlen1"], hparams["maxlen2"])
        languages = (hparams["src_lang"], hparams["tgt_lang"])
        check_data_dir(data_dir)
        paths, reader = split_files(data_dir, "train", *languages)

        def sample():  # read only where the subword model is trained
            yield from sample_pairs(iter_parallel(*paths, reader), SUBWORD_SAMPLE_SENTENCES // 2,
                                    hparams["seed"])

        self.subwords = Subwords.train_or_load(model_dir, sample(), hparams["vocab_size"],
                                               hparams["subword_model_type"])
        cache = hparams.get("corpus_cache") or os.path.join(model_dir, filenames.PREPARED)
        self.fingerprint = fingerprint(data_dir, "train", *languages)  # {file name: sha256}
        self.prepared = PreparedSplit.open_or_prepare(cache, paths, reader, self.fingerprint,
                                                      self.subwords, log)
        self._report(data_dir, log)
        both_ways = hparams["bidirectional_epochs"]
        if both_ways:
            epochs = "epoch trains" if both_ways == 1 else f"{both_ways} epochs train"
            log(f"both ways (BiT): the first {epochs} on every pair and every pair reversed "
                "(about twice the batches)")
        self.sampler = None
        if hparams.get("subword_alpha", 0.0) > 0:
            self.sampler = self._sampler(paths, reader, hparams["subword_alpha"], log)
        self.val_sources, self.val_targets, _ = load_split(data_dir, "val", *languages)

    def _report(self, data_dir, log):
        """Says what the training split holds: its pairs, those dropped, its unknown pieces."""
        record, hparams = self.prepared.record, self.hparams
        kept = len(pipeline.fitting_pairs(self.prepared.sources, self.prepared.targets,
                                          self.maxlens))
        unknown = record["unknown"]
        log(f"train: {record['pairs']} pairs from {data_dir}; {record['empty']} with an empty "
            f"side and {record['pairs'] - kept} longer than maxlen1={hparams['maxlen1']}/maxlen2="
            f"{hparams['maxlen2']} dropped; {kept} kept; subword vocabulary "
            f"{self.subwords.vocab_size} ({self.subwords.path}); prepared in "
            f"{self.prepared.folder}")
        log(f"unknown subwords: {unknown['sentences']} of {2 * record['pairs']} training "
            f"sentences (both sides) hold one; {unknown['pieces']} of {unknown['all pieces']} "
            f"pieces ({unknown['pieces'] / max(unknown['all pieces'], 1):.2%})")

    def _sampler(self, paths, reader, alpha, log):
        """Returns the `SegmentationSampler` of the training sentences; DataError for a corpus
        over `SAMPLED_SEGMENTATION_PAIRS`."""
        pairs = self.prepared.record["pairs"]
        if pairs > SAMPLED_SEGMENTATION_PAIRS:
            raise DataError(
                f"{paths[0]}: subword_alpha {alpha} keeps every training sentence's best "
                f"segmentations in memory, for at most {SAMPLED_SEGMENTATION_PAIRS:,} pairs; "
                f"this corpus has {pairs:,}: train it with subword_alpha 0")
        sources, targets, _ = read_parallel(*paths, reader)
        sampler = SegmentationSampler(self.subwords, sources + targets, alpha)
        log(f"subword regularization: alpha {alpha}, among the "
            f"{len(sampler.scores) / len(sampler.first[1:]):.1f} best segmentations of each "
            "sentence on average, drawn anew each epoch")
        return sampler

    def train_columns(self, epoch):
        """Returns ``(sources, targets)`` of `epoch` as `IdColumn`s: the best segmentations,
        or with `subword_alpha` those drawn with ``(seed, epoch)``, so that a resumed run draws
        the same; in the first `bidirectional_epochs`, every pair both ways."""
        if self.sampler is None:
            sources, targets = self.prepared.sources, self.prepared.targets
        else:
            drawn = self.sampler.draw([self.hparams["seed"], epoch])
            half = len(drawn) // 2  # the sampler holds the sources, then the targets
            sources, targets = drawn.rows(slice(0, half)), drawn.rows(slice(half, None))
        if epoch < self.hparams["bidirectional_epochs"]:  # BiT (Ding et al., 2021)
            return IdColumn.joined(sources, targets), IdColumn.joined(targets, sources)
        return sources, targets

    def epochs_alike(self, num_epochs):
        """Returns ``[(first epoch, count), ...]``: the runs of a training's `num_epochs` whose
        batches are alike, those on the pairs both ways (`bidirectional_epochs`) apart."""
        both_ways = min(self.hparams["bidirectional_epochs"], num_epochs)
        return [(first, count) for first, count in ((0, both_ways),
                                                    (both_ways, num_epochs - both_ways)) if count]

    def train_batches(self, epoch, skip=0, share=None):
        """Returns the global batches of `epoch` (a `tf.data.Dataset`) from batch `skip` on,
        shuffled with ``seed + epoch``; `share`: see `pipeline.BatchReader`."""
        return pipeline.make_dataset(*self.train_columns(epoch), *self._batching(epoch),
                                     skip=skip, share=share)

    def train_batch_shapes(self, epoch):
        """Returns ``(rows, source width, target width)`` of each batch of `epoch`, in the
        order `train_batches` gives them, without reading an id: ``(batches, 3)``."""
        columns = self.train_columns(epoch)
        plan = pipeline.epoch_plan(*columns, *self._batching(epoch))
        return pipeline.batch_shapes(*columns, plan, self.maxlens)

    def _batching(self, epoch):
        """``(batch_size, batch_tokens, maxlens, seed)`` of `epoch`'s plan."""
        return (self.hparams["batch_size"], self.hparams["batch_tokens"], self.maxlens,
                self.hparams["seed"] + epoch)
