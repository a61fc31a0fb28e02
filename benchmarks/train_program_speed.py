"""train.py as users run it, against the same program at an earlier revision, in turns.

    python benchmarks/train_program_speed.py --baseline REV [--hparams small] [--steps 200]
                                             [--rounds 2] [--data_dir DIR]
                                             [--baseline_hparams H]

Each round runs `python train.py --hparams H --log_every 1` for its first STEPS updates
(then stops it: the epochs are as many as those take) once from this checkout and once from
REV (its files taken with `git archive`), in alternating order, each in a fresh logdir (the
subword model of each program's first run is copied into its later ones, so that no run
spends its time training one). With `--baseline_hparams` REV runs those (two recipes on one
machine: `--baseline HEAD` compares them in the same code). A run's figure is the median of
its logged updates' target tokens/s (`history.jsonl`); printed: every run's (with the seconds
from its start to epoch 2, where STEPS reach it, and its loss at three updates), the median per
program, and the median of the rounds' paired ratios (this checkout / REV). What the whole
program does per update (the lock, signal handling, logging) counts, which a step benchmark
leaves out.
"""

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from prerequisites import DEFAULT_DATA, ROOT, in_turns, require_data, tree_at  # noqa: E402

from kyu_transformer.training.plots import read_history  # noqa: E402


def run_program(tree, logdir, args, hparams, subwords):
    """Runs train.py of `tree` into `logdir`; returns its first `args.steps` updates' records
    and the seconds from its start to its first update of epoch 2 (None before)."""
    if subwords:
        os.makedirs(logdir)
        for path in subwords:
            shutil.copy(path, logdir)
    command = [sys.executable, os.path.join(tree, "train.py"), "--hparams", hparams,
               "--data_dir", os.path.abspath(args.data_dir), "--logdir", logdir,
               "--num_epochs", "1000", "--max_minutes", "0", "--log_every", "1",
               "--checkpoint_every", "0", "--eval_sentences", "0"]
    history = os.path.join(logdir, "history.jsonl")
    with tempfile.TemporaryFile("w+") as output:
        started, epoch_one = time.time(), None
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True,
                                   cwd=tree, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                                  "PYTHONPATH": tree})
        while process.poll() is None and len(train_records(history)) < args.steps:
            if epoch_one is None and any(record["epoch"] > 1
                                         for record in train_records(history)[-3:]):
                epoch_one = time.time() - started
            time.sleep(0.2)
        process.kill()  # its first STEPS updates are all this measures
        process.wait()
        records = train_records(history)
        if len(records) < args.steps:
            output.seek(0)
            sys.exit(f"error: train.py in {tree} stopped after {len(records)} updates:\n"
                     f"{output.read()[-2000:]}")
    return records[:args.steps], epoch_one


def train_records(history):
    """The `train` records of a history file (the training log's reader)."""
    return [record for record in read_history(history) if record.get("kind", "train") == "train"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="REV")
    parser.add_argument("--hparams", default="small")
    parser.add_argument("--steps", type=int, default=200, help="updates per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--baseline_hparams", default=None, help="REV's (default --hparams)")
    args = parser.parse_args()
    require_data(args.data_dir)
    trees = {"this checkout": ROOT, f"at {args.baseline}": tree_at(args.baseline)}
    hparams = dict(zip(trees, (args.hparams, args.baseline_hparams or args.hparams)))
    scratch = tempfile.mkdtemp(prefix="train_program_speed_")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    medians = {label: [] for label in trees}
    subwords = {label: [] for label in trees}
    for round_number in range(args.rounds):
        for label in in_turns(trees, round_number):
            logdir = os.path.join(scratch, f"{round_number}-{len(medians[label])}-{label[:2]}")
            records, epoch_one = run_program(trees[label], logdir, args, hparams[label],
                                             subwords[label])
            rates = [record["tokens_per_sec"] for record in records]
            subwords[label] = subwords[label] or [os.path.join(logdir, name) for name in
                                                  ("subwords.model", "subwords.vocab")]
            medians[label].append(statistics.median(rates))
            print(f"round {round_number + 1}, {label}: median {medians[label][-1]:,.0f} target "
                  f"tokens/s over {len(rates)} updates; " + (
                      f"{epoch_one:.1f} s from start to epoch 2; " if epoch_one else "")
                  + "loss at updates " + ", ".join(
                      f"{index + 1}: {records[index]['loss']:.3f}"
                      for index in sorted({0, len(records) // 2, len(records) - 1})), flush=True)
    current, baseline = medians.values()
    ratios = [ours / theirs for ours, theirs in zip(current, baseline)]
    for label, values in medians.items():
        print(f"{label}: median {statistics.median(values):,.0f} target tokens/s "
              f"({args.rounds} runs of {args.steps} updates, --hparams {hparams[label]})")
    print(f"ratio this checkout / at {args.baseline}: {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{ratio:.3f}' for ratio in ratios)})")


if __name__ == "__main__":
    main()
