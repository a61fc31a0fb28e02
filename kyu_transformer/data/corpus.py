"""Makes a parallel corpus ready for training: subwords, ids, batches."""

from kyu_transformer.conventions import UNK_ID
from kyu_transformer.data import pipeline
from kyu_transformer.data.subwords import SegmentationSampler, Subwords, add_markers
from kyu_transformer.data.text import load_split


class Corpus:
    """Holds the splits of corpus folder `data_dir`: the training split as subword ids, the
    validation split as text. The subword model lives in `model_dir` (the logdir), trained on the
    training split the first time. `log` receives the reports, the unknown pieces among them (a
    fine-tuning run's subword model may lack characters)."""

    def __init__(self, data_dir, model_dir, hparams, log=print):
        self.hparams, self.maxlens = hparams, (hparams["maxlen1"], hparams["maxlen2"])
        languages = (hparams["src_lang"], hparams["tgt_lang"])
        sources, targets, empty = load_split(data_dir, "train", *languages)
        self.subwords = Subwords.train_or_load(
            model_dir, sources + targets, hparams["vocab_size"], hparams["subword_model_type"])
        source_ids, target_ids = self.subwords.encode(sources), self.subwords.encode(targets)
        self.train = add_markers(source_ids, target_ids, *self.maxlens)
        log(f"train: {len(sources)} pairs from {data_dir}; {empty} with an empty side and "
            f"{self.train[3]} longer than maxlen1={hparams['maxlen1']}/maxlen2="
            f"{hparams['maxlen2']} dropped; {len(self.train[0])} kept; subword vocabulary "
            f"{self.subwords.vocab_size} ({self.subwords.path})")
        unknown = [ids.count(UNK_ID) for ids in source_ids + target_ids]
        pieces = sum(len(ids) for ids in source_ids + target_ids)
        log(f"unknown subwords: {sum(map(bool, unknown))} of {len(unknown)} training sentences "
            f"(both sides) hold one; {sum(unknown)} of {pieces} pieces "
            f"({sum(unknown) / max(pieces, 1):.2%})")
        self.sampler = None
        if hparams.get("subword_alpha", 0.0) > 0:
            self.sampler = SegmentationSampler(self.subwords, sources + targets,
                                               hparams["subword_alpha"])
            log(f"subword regularization: alpha {hparams['subword_alpha']}, among the "
                f"{len(self.sampler.scores) / len(self.sampler.first[1:]):.1f} best "
                "segmentations of each sentence on average, drawn anew each epoch")
        self.val_sources, self.val_targets, _ = load_split(data_dir, "val", *languages)

    def train_pairs(self, epoch):
        """Returns ``(sources, targets_in, targets_out)`` of `epoch`: the best segmentations, or
        with `subword_alpha` those drawn with ``(seed, epoch)``, so that a resumed run draws the
        same."""
        if self.sampler is None:
            return self.train[:3]
        ids = self.sampler.draw([self.hparams["seed"], epoch])
        half = len(ids) // 2  # the sampler holds the sources, then the targets
        return add_markers(ids[:half], ids[half:], *self.maxlens)[:3]

    def train_batches(self, epoch):
        """Returns the global batches of `epoch` (a `tf.data.Dataset`), shuffled with
        ``seed + epoch``."""
        return pipeline.make_dataset(*self.train_pairs(epoch), self.hparams["batch_size"],
                                     self.hparams["batch_tokens"], max(self.maxlens),
                                     seed=self.hparams["seed"] + epoch, maxlens=self.maxlens)

