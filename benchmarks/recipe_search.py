"""One candidate of a recipe search: train it at a fixed commit, choose alpha on val, say its row.

    python benchmarks/recipe_search.py --name NAME --hparams small,dropout_rate=0.3
        [--commit REV] [--runs_dir DIR] [--data_dir DIR] [--alphas 0.6 1.0 1.4 1.8]
        [--average_last 8] [--test] [--eval_only]

The code is the repository's files at REV (default HEAD, `git archive`), so that work on the
checkout does not touch a run of an hour. Training is `train.py --hparams H` into
`DIR/NAME` under `/usr/bin/time -v` (its wall time and peak memory); a killed candidate resumes
when run again. Then `eval.py --split val --beam_size 4 --average_last N --alpha A` for each
alpha, and with `--test` test_2016_flickr once, at the alpha val chose. Printed: one Markdown row
for `benchmarks/RESULTS.md`; every figure also goes to `DIR/NAME/search.json`.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

from prerequisites import DEFAULT_DATA, ROOT, require_data, tree_at  # noqa: E402

from kyu_transformer import filenames  # noqa: E402


def run_logged(command, log_path, cwd):
    """Runs `command`, its output appended to `log_path` as it comes; returns that output."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        start = log.tell()
        code = subprocess.run(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                   "PYTHONUNBUFFERED": "1"}).returncode
    with open(log_path, encoding="utf-8") as log:
        log.seek(start)
        output = log.read()
    if code != 0:
        program = next(os.path.basename(word) for word in command if word.endswith(".py"))
        sys.exit(f"error: {program} failed ({code}); see {log_path}")
    return output


def train(tree, args, logdir):
    """`train.py` under `/usr/bin/time -v`: its steps, minutes and peak memory."""
    command = ["/usr/bin/time", "-v", sys.executable, os.path.join(tree, "train.py"),
               "--hparams", args.hparams, "--data_dir", args.data_dir, "--logdir", logdir]
    output = run_logged(command, os.path.join(args.runs_dir, f"{args.name}.train.log"), tree)
    steps = re.findall(r"done: \d+ epochs, (\d+) steps", output)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", output)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", output)
    parts = [float(part) for part in wall.group(1).split(":")] if wall else []
    minutes = sum(value * 60 ** index for index, value in enumerate(reversed(parts))) / 60
    return {"steps": int(steps[-1]) if steps else None, "train_minutes": round(minutes, 1),
            "max_rss_gb": round(int(rss.group(1)) / 1e6, 2) if rss else None}


def bleu(tree, args, logdir, split, alpha):
    """BLEU of `eval.py` on `split` at `alpha` (beam 4, the last checkpoints averaged)."""
    name = f"{split}-avg{args.average_last}-alpha{alpha}"
    command = [sys.executable, os.path.join(tree, "eval.py"), "--logdir", logdir, "--split",
               split, "--data_dir", args.data_dir, "--beam_size", "4", "--alpha", str(alpha),
               "--average_last", str(args.average_last), "--name", name]
    run_logged(command, os.path.join(args.runs_dir, f"{args.name}.eval.log"), tree)
    path = filenames.evaluation_file(os.path.join(logdir, filenames.EVAL), name, filenames.RESULT)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["bleu"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True, help="the candidate's name (its logdir)")
    parser.add_argument("--hparams", required=True, help="train.py's --hparams")
    parser.add_argument("--commit", default="HEAD", help="the code's revision")
    parser.add_argument("--runs_dir", default=os.path.join(ROOT, "runs"))
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6, 1.0, 1.4, 1.8])
    parser.add_argument("--average_last", type=int, default=8)
    parser.add_argument("--test", action="store_true", help="also score test_2016_flickr")
    parser.add_argument("--eval_only", action="store_true", help="the logdir is trained")
    args = parser.parse_args()
    args.data_dir = os.path.abspath(require_data(args.data_dir))
    args.runs_dir = os.path.abspath(args.runs_dir)
    os.makedirs(args.runs_dir, exist_ok=True)
    parsed = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.commit],
                            capture_output=True, text=True)
    if parsed.returncode != 0:
        sys.exit(f"error: --commit {args.commit}: not a revision of {ROOT}")
    commit = parsed.stdout.strip()
    tree, logdir = tree_at(commit), os.path.join(args.runs_dir, args.name)
    record_path = os.path.join(logdir, "search.json")
    record = {}
    if os.path.isfile(record_path):
        with open(record_path, encoding="utf-8") as handle:
            record = json.load(handle)
    record.update(name=args.name, hparams=args.hparams, commit=commit,
                  date=record.get("date") or datetime.date.today().isoformat())
    if not args.eval_only:  # a resumed candidate adds its parts' minutes up
        trained = train(tree, args, logdir)
        trained["train_minutes"] += record.get("train_minutes", 0)
        trained["max_rss_gb"] = max(trained["max_rss_gb"] or 0, record.get("max_rss_gb") or 0)
        record.update(trained)
    record["val"] = {str(alpha): bleu(tree, args, logdir, "val", alpha) for alpha in args.alphas}
    record["alpha"] = max(record["val"], key=record["val"].get)
    if args.test:
        record["test"] = bleu(tree, args, logdir, "test_2016_flickr", record["alpha"])
    with open(record_path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
    val = " / ".join(f"{record['val'][str(alpha)]:.2f}" for alpha in args.alphas)
    print(f"| {record['date']} | `{commit}` | {args.name}: `{args.hparams}` | "
          f"{record.get('steps')} | {record.get('train_minutes')} min | {val} "
          f"({record['alpha']}) | {record.get('test', '')} | {record.get('max_rss_gb')} GB |")


if __name__ == "__main__":
    main()
