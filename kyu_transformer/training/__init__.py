"""Training a `Transformer`: the `trainer` and its `step` under any tf.distribute strategy
(`distribution`), the run's `checkpoints` (and resuming from them), learning-rate `schedule`,
`optimizer`, `clock` (time budget), `log` and `plots`, `validation` BLEU, and `fine_tuning`."""
