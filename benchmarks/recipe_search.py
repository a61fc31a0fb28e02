"""One candidate of a recipe search: train it at a fixed commit, choose alpha on val, say its row.

    python benchmarks/recipe_search.py --name NAME --hparams small,dropout_rate=0.3
        [--commit REV] [--runs_dir DIR] [--data_dir DIR] [--alphas 0.6 1.0 1.4 1.8]
        [--beam_size 4] [--average_last 8] [--mixed_precision no] [--budget small] [--test]
        [--eval_only]

First the candidate's training compute is counted (`training_flops.py` of the same files, or
of this checkout for a commit older than it: every batch its run trains on) beside
`--budget`'s, once per candidate: a candidate over it is refused; a signal during the count
discards it. The code is
the repository's files at REV (default HEAD, `git archive`), so that work on the
checkout does not touch a run of an hour. Training is `train.py --hparams H` into
`DIR/NAME` (its wall time, its peak memory from `os.wait4`, and the precision it trained in,
as hparams.json saved `auto`'s choice); a stopped candidate resumes
when run again. Then `eval.py --split val --beam_size B --average_last N --alpha A` for each
alpha, and with `--test` test_2016_flickr once, at the alpha val chose, every one decoded in
the same precision (float32 unless `--mixed_precision` says otherwise: eval.py's `auto` would
measure the machine anew each time, and a busy machine can make it pick another precision for
another alpha). Scored again (`--eval_only`, with other decoding flags), val's figures
replace the earlier ones and a test figure is dropped. Printed: one Markdown row for
`benchmarks/RESULTS.md`; every figure goes to `DIR/NAME/search.json` as its part ends, a part
stopped by a signal (train.py's minutes so far) too: SIGTERM to this process is passed on to
train.py as SIGINT, which stops it after a checkpoint, as Ctrl-C does.
"""

import argparse
import datetime
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

from prerequisites import DEFAULT_DATA, ROOT, recipe, require_data, tree_at  # noqa: E402

from kyu_transformer import filenames  # noqa: E402
from kyu_transformer.safety.writes import write_text  # noqa: E402

# The part running now: [] between parts, [None] while it starts, [process] while it runs.
RUNNING = []


def on_signal(record_path, number, frame):  # pylint: disable=unused-argument
    """While a part runs, SIGTERM is passed on to it as SIGINT (train.py then stops after a
    checkpoint) and its end awaited; SIGINT (Ctrl-C) reaches it with this process group, and
    is not passed on twice. Between parts, the search stops at once."""
    if not RUNNING:
        sys.exit(f"error: stopped by {signal.Signals(number).name}; what was done is in "
                 f"{record_path}: run the same command again to go on")
    if number == signal.SIGTERM and RUNNING[0] is None:
        RUNNING.append(number)  # passed on once it has started
    elif number == signal.SIGTERM:
        pass_on(RUNNING[0])


def pass_on(process):
    try:
        os.kill(process.pid, signal.SIGINT)
    except ProcessLookupError:  # it has just ended
        pass


def run_logged(command, log_path, cwd):
    """Runs `command`, its output appended to `log_path` as it comes; ``(exit code, output,
    minutes, peak resident memory in GB)``: the process's own, from `os.wait4`."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        start, began = log.tell(), time.monotonic()
        RUNNING[:] = [None]
        try:
            RUNNING[0] = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                               "PYTHONUNBUFFERED": "1"})
            if len(RUNNING) > 1:  # SIGTERM while it started
                pass_on(RUNNING[0])
            _, status, usage = os.wait4(RUNNING[0].pid, 0)
            RUNNING[0].returncode = os.waitstatus_to_exitcode(status)
        finally:
            RUNNING.clear()
    with open(log_path, encoding="utf-8") as log:
        log.seek(start)
        return (os.waitstatus_to_exitcode(status), log.read(),
                (time.monotonic() - began) / 60, usage.ru_maxrss / 1e6)  # kB on Linux


def failed(command, code, log_path, record_path):
    """The line a failed part ends the search with (the parts before it are in search.json)."""
    program = next(os.path.basename(word) for word in command if word.endswith(".py"))
    again = ("run the same command with --eval_only to score again" if program == "eval.py"
             else "run the same command again to go on")
    return (f"error: {program} stopped ({code}); see {log_path}. What was done is in "
            f"{record_path}: {again}")


def train(tree, args, logdir, record, record_path):
    """`train.py`; its steps, minutes and peak memory go into `record` (a resumed candidate's
    minutes add up) even when it stops early, e.g. by a signal."""
    command = [sys.executable, os.path.join(tree, "train.py"), "--hparams", args.hparams,
               "--data_dir", args.data_dir, "--logdir", logdir]
    log_path = os.path.join(args.runs_dir, f"{args.name}.train.log")
    code, output, minutes, rss_gb = run_logged(command, log_path, tree)
    steps = re.findall(r"done: \d+ epochs, (\d+) steps", output)
    record.update(steps=int(steps[-1]) if steps else record.get("steps"),
                  trained_in=trained_in(logdir),
                  train_minutes=round(minutes + record.get("train_minutes", 0), 1),
                  max_rss_gb=max(round(rss_gb, 2), record.get("max_rss_gb") or 0))
    save(record, record_path)
    if code != 0:
        sys.exit(failed(command, code, log_path, record_path))


def trained_in(logdir):
    """The precision the run trained in, as its hparams.json saved it: `auto` is chosen at
    the start by a probe of the machine, which a busy machine can tip either way."""
    path = os.path.join(logdir, filenames.HPARAMS)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle).get("mixed_precision")


def bleu(tree, args, logdir, split, alpha, record_path):
    """BLEU of `eval.py` on `split` at `alpha` (--beam_size, the last checkpoints averaged)."""
    name = f"{split}-beam{args.beam_size}-avg{args.average_last}-alpha{alpha}"
    command = [sys.executable, os.path.join(tree, "eval.py"), "--logdir", logdir, "--split",
               split, "--data_dir", args.data_dir, "--beam_size", str(args.beam_size),
               "--alpha", str(alpha),
               "--average_last", str(args.average_last), "--name", name,
               "--mixed_precision", args.mixed_precision]
    log_path = os.path.join(args.runs_dir, f"{args.name}.eval.log")
    code = run_logged(command, log_path, tree)[0]
    if code != 0:
        sys.exit(failed(command, code, log_path, record_path))
    path = filenames.evaluation_file(os.path.join(logdir, filenames.EVAL), name, filenames.RESULT)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["bleu"]


def count_flops(tree, args, record, record_path):
    """Counts the candidate's training FLOPs and the budget recipe's (`training_flops.py` at
    the candidate's commit) into `record`; stops with that program's line where the
    candidate's exceed the budget. A resumed candidate keeps its counts."""
    counted_for = [args.hparams, record["commit"], args.budget, args.data_dir]
    if record.get("flops_counted_for") == counted_for:
        return
    counts_path = os.path.join(args.runs_dir, f"{args.name}.flops.json")
    script = os.path.join(tree, "benchmarks", "training_flops.py")
    if not os.path.isfile(script):  # a commit older than the count
        print(f"note: {record['commit']} has no benchmarks/training_flops.py: counted with "
              "this checkout's, on the batches its own code makes")
        script = os.path.join(ROOT, "benchmarks", "training_flops.py")
    command = [sys.executable, script, "--hparams", args.hparams, "--budget", args.budget,
               "--data_dir", args.data_dir, "--scratch", os.path.join(args.runs_dir, "flops"),
               "--json", counts_path]
    log_path = os.path.join(args.runs_dir, f"{args.name}.flops.log")
    code, output = run_logged(command, log_path, tree)[:2]
    lines = output.strip().splitlines()
    if code != 0:  # its own line where it refuses the candidate (over the budget)
        sys.exit(lines[-1] if lines and lines[-1].startswith("error: ") else
                 failed(command, code, log_path, record_path))
    print("\n".join(lines[-2:]))
    with open(counts_path, encoding="utf-8") as handle:
        counts = json.load(handle)
    record.update(flops_counted_for=counted_for, flops=counts["candidate"]["flops"],
                  updates=counts["candidate"]["updates"], budget=args.budget,
                  budget_flops=counts["budget"]["flops"], flops_ratio=round(counts["ratio"], 3))
    save(record, record_path)


def save(record, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text(path, json.dumps(record, indent=2))


def parse_args():
    """Parses the flags; the folders made absolute, the runs' folder made."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True, help="the candidate's name (its logdir)")
    parser.add_argument("--hparams", required=True, help="train.py's --hparams")
    parser.add_argument("--commit", default="HEAD", help="the code's revision")
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs"))
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6, 1.0, 1.4, 1.8])
    parser.add_argument("--beam_size", type=int, default=4, help="eval.py's beam, every figure")
    parser.add_argument("--average_last", type=int, default=8,
                        help="eval.py's checkpoints averaged, every figure")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"],
                        help="eval.py's precision of decoding, the same for every figure")
    parser.add_argument("--budget", default="small", type=recipe,
                        help="the recipe whose training FLOPs a candidate may not exceed")
    parser.add_argument("--test", action="store_true", help="also score test_2016_flickr")
    parser.add_argument("--eval_only", action="store_true", help="the logdir is trained")
    args = parser.parse_args()
    args.data_dir = os.path.abspath(require_data(args.data_dir))
    args.runs_dir = os.path.abspath(args.runs_dir)
    os.makedirs(args.runs_dir, exist_ok=True)
    return args


def main():
    args = parse_args()
    parsed = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.commit],
                            capture_output=True, text=True)
    if parsed.returncode != 0:
        sys.exit(f"error: --commit {args.commit}: not a revision of {ROOT}")
    commit = parsed.stdout.strip()
    tree, logdir = tree_at(commit, flag="--commit"), os.path.join(args.runs_dir, args.name)
    record_path = os.path.join(logdir, "search.json")
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, functools.partial(on_signal, record_path))
    record = {}
    if os.path.isfile(record_path):
        with open(record_path, encoding="utf-8") as handle:
            record = json.load(handle)
    record.update(name=args.name, hparams=args.hparams, commit=commit,
                  decoded_in=args.mixed_precision, beam_size=args.beam_size,
                  average_last=args.average_last,
                  date=record.get("date") or datetime.date.today().isoformat())
    if not args.eval_only:
        count_flops(tree, args, record, record_path)
        train(tree, args, logdir, record, record_path)
    # val scored again may choose another alpha, or decode otherwise (precision, beam,
    # checkpoints averaged): an earlier test figure would no longer be this record's
    record["val"] = {}
    record.pop("test", None)
    for alpha in args.alphas:
        record["val"][str(alpha)] = bleu(tree, args, logdir, "val", alpha, record_path)
        save(record, record_path)
    record["alpha"] = max(record["val"], key=record["val"].get)
    save(record, record_path)
    if args.test:
        record["test"] = bleu(tree, args, logdir, "test_2016_flickr", record["alpha"],
                              record_path)
    save(record, record_path)
    print(row(record, args))


def row(record, args):
    """The candidate's Markdown row for `benchmarks/RESULTS.md`."""
    val = " / ".join(f"{record['val'][str(alpha)]:.2f}" for alpha in args.alphas)
    counted = (f" ({record['flops_ratio']} of {record['budget']}'s FLOPs)"
               if "flops_ratio" in record else "")  # a candidate counted before the count
    return (f"| {record['date']} | `{record['commit']}` | {args.name}: `{args.hparams}` | "
            f"{record.get('steps')}{counted} | {record.get('train_minutes')} min | {val} "
            f"({record['alpha']}; beam {record['beam_size']}, the last {record['average_last']} "
            f"averaged) | {record.get('test', '')} | {record.get('max_rss_gb')} GB |")


if __name__ == "__main__":
    main()
