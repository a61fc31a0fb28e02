"""Keeps a run's files whole: whole-file `writes` (and full disks), the logdir's `lock`,
and `signals` taken as requests to stop after an update."""
