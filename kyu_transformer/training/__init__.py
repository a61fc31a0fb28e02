"""Holds what trains a `Transformer`: the `trainer` and its `step` under any tf.distribute
strategy (`distribution`), the run's `logdir` and `checkpoints` (and resuming from them), the
learning-rate `schedule`, the `optimizer`, the `clock` (time budget), the run's `history`
(history.jsonl, TensorBoard, progress) and `plots`, `validation` BLEU, token accuracy
(`metrics`) and `fine_tuning`."""
