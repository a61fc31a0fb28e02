"""Holds what trains a `Transformer`: the `trainer` and its `step` under any tf.distribute
strategy (`distribution`), the run's `checkpoints` (and resuming from them), the learning-rate
`schedule`, the `optimizer`, the `clock` (time budget), the `log` and `plots`, `validation` BLEU,
and `fine_tuning`."""
