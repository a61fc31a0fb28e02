"""A parallel corpus made ready for training: subwords, ids, batches."""

from kyu_transformer import data, pipeline


class Corpus:
    """The train and validation splits of corpus folder `data_dir`, as subword ids.

    The subword model lives in `model_dir` (the logdir), trained there on both sides of the
    training split the first time. `hparams` holds `src_lang`, `tgt_lang`, `vocab_size`,
    `subword_model_type`, `maxlen1`, `maxlen2`, `batch_size`, `batch_tokens` and `seed`;
    `log` takes one line of report.
    """

    def __init__(self, data_dir, model_dir, hparams, log=print):
        self.hparams = hparams
        self.data_dir = data_dir
        languages = (hparams["src_lang"], hparams["tgt_lang"])
        sources, targets, empty = data.load_split(data_dir, "train", *languages)
        self.subwords = data.Subwords.train_or_load(
            model_dir, sources + targets, hparams["vocab_size"], hparams["subword_model_type"])
        self.train = data.add_markers(self.subwords.encode(sources), self.subwords.encode(targets),
                                      hparams["maxlen1"], hparams["maxlen2"])
        log(f"train: {len(sources)} pairs from {data_dir}; {empty} with an empty side and "
            f"{self.train[3]} longer than maxlen1={hparams['maxlen1']}/maxlen2="
            f"{hparams['maxlen2']} dropped; {len(self.train[0])} kept; subword vocabulary "
            f"{self.subwords.vocab_size} ({self.subwords.path})")
        self.val_sources, self.val_targets, _ = data.load_split(data_dir, "val", *languages)

    def train_batches(self, epoch):
        """The global batches of `epoch`: shuffled with ``seed + epoch``."""
        sources, targets_in, targets_out, _ = self.train
        return pipeline.make_dataset(
            sources, targets_in, targets_out, self.hparams["batch_size"],
            self.hparams["batch_tokens"], max(self.hparams["maxlen1"], self.hparams["maxlen2"]),
            shuffle=True, seed=self.hparams["seed"] + epoch)
