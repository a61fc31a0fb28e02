"""train.py's start-up and memory on corpora of growing size: Multi30k's training split repeated.

    python benchmarks/corpus_scale.py [--sizes 1,20,60] [--hparams small] [--data_dir DIR]
                                      [--baseline REV]

For each size N, a corpus folder holding Multi30k's training split N times over (made on the
fly in a temporary folder, with its val and test splits) is trained by `python train.py
--hparams H --mixed_precision no --num_epochs 1 --steps_per_epoch 3` twice in one logdir: the
first run trains the subword model and prepares the corpus; the second (`--num_epochs 2`)
finds both and trains 3 more updates. Printed per run: the preparation's seconds (the program's
own figure), the seconds from start to the first update (its first record in `history.jsonl`,
logged every update) and to exit, and the peak memory (the process's maximum resident set).
With `--baseline REV`, train.py at git revision REV runs the first run's command beside, for
its start-to-exit and peak memory on the same corpora.
"""

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from prerequisites import DEFAULT_DATA, ROOT, require_data, tree_at  # noqa: E402

from kyu_transformer.training.plots import read_history  # noqa: E402

SPLITS = ("val", "test_2016_flickr")


def repeated_corpus(data_dir, folder, times):
    """Writes `data_dir`'s training split `times` over (plain text) and its other splits into
    `folder`; returns the count of training lines."""
    os.makedirs(folder, exist_ok=True)
    lines = 0
    for lang in ("de", "en"):
        with gzip.open(os.path.join(data_dir, f"train.{lang}.gz"), "rb") as handle:
            text = handle.read()
        with open(os.path.join(folder, f"train.{lang}"), "wb") as out:
            for _ in range(times):
                out.write(text)
        lines = text.count(b"\n") * times
        for split in SPLITS:
            shutil.copy(os.path.join(data_dir, f"{split}.{lang}.gz"), folder)
    return lines


def run_train(tree, data_dir, logdir, hparams, epochs):
    """Runs train.py of `tree`; returns its figures: seconds to the first update and to exit,
    peak memory (bytes), the preparation's seconds (None where it prepared nothing)."""
    command = [sys.executable, os.path.join(tree, "train.py"), "--hparams", hparams,
               "--mixed_precision", "no", "--num_epochs", str(epochs), "--steps_per_epoch", "3",
               "--log_every", "1", "--eval_sentences", "0", "--data_dir", data_dir,
               "--logdir", logdir]
    history, first = os.path.join(logdir, "history.jsonl"), None
    seen = _train_records(history)
    with tempfile.TemporaryFile("w+") as output:
        started = time.time()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True,
                                   cwd=tree, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                                  "PYTHONPATH": tree})
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if first is None and _train_records(history) > seen:
                first = time.time() - started
            if pid:
                break
            time.sleep(0.05)
        process.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.time() - started
        output.seek(0)
        text = output.read()
    if process.returncode != 0:
        sys.exit(f"error: train.py in {tree} failed:\n{text[-3000:]}")
    prepared = re.search(r"^prepared [\d,]+ pairs in ([\d.]+) s", text, re.MULTILINE)
    return dict(first_update=first, exit=seconds, peak_bytes=usage.ru_maxrss * 1024,
                preparation=float(prepared.group(1)) if prepared else None)


def _train_records(history):
    """Counts the `train` records of a history file (0 if there is none yet)."""
    if not os.path.isfile(history):
        return 0
    return sum(record.get("kind", "train") == "train" for record in read_history(history))


def row(label, figures, pairs):
    """One printed line of a run's figures."""
    preparation = figures.get("preparation")
    return (f"  {label:28s} "
            + (f"prepared in {preparation:6.1f} s ({preparation / pairs * 1e6:5.1f} us/pair), "
               if preparation else "")
            + (f"first update at {figures['first_update']:6.1f} s, "
               if figures.get("first_update") else "")
            + f"exit at {figures['exit']:6.1f} s, peak memory "
            f"{figures['peak_bytes'] / 2**30:.2f} GiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,20,60", help="repeats of the training split")
    parser.add_argument("--hparams", default="small")
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--baseline", metavar="REV", help="also run train.py at git REV")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = parser.parse_args()
    require_data(args.data_dir)
    sizes = [int(size) for size in args.sizes.split(",")]
    baseline = tree_at(args.baseline) if args.baseline else None
    scratch = tempfile.mkdtemp(prefix="corpus_scale_")
    results = []
    try:
        for size in sizes:
            corpus = os.path.join(scratch, f"x{size}")
            pairs = repeated_corpus(args.data_dir, corpus, size)
            logdir = os.path.join(scratch, f"log-x{size}")
            result = dict(size=size, pairs=pairs,
                          preparing=run_train(ROOT, corpus, logdir, args.hparams, 1),
                          prepared=run_train(ROOT, corpus, logdir, args.hparams, 2))
            print(f"x{size}: {pairs:,} pairs", flush=True)
            print(row("this checkout, first run", result["preparing"], pairs))
            print(row("this checkout, prepared", result["prepared"], pairs), flush=True)
            if baseline:
                result["baseline"] = run_train(baseline, corpus, logdir + "-baseline",
                                               args.hparams, 1)
                print(row(f"at {args.baseline}", result["baseline"], pairs), flush=True)
            results.append(result)
            shutil.rmtree(corpus)
            shutil.rmtree(logdir, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summarize(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


def summarize(results):
    """Prints the targets' figures: the peak over sizes, the prepared runs' memory against the
    smallest size's, the preparation per pair."""
    peak = max(max(r["preparing"]["peak_bytes"], r["prepared"]["peak_bytes"]) for r in results)
    first = max(r["prepared"]["first_update"] for r in results)
    print(f"\npeak memory at any size: {peak / 2**30:.2f} GiB; a start with a prepared corpus "
          f"reaches its first update in at most {first:.1f} s")
    smallest, largest = results[0], results[-1]
    print(f"prepared runs' peak memory, x{largest['size']} / x{smallest['size']}: "
          f"{largest['prepared']['peak_bytes'] / smallest['prepared']['peak_bytes']:.3f}")
    for r in results:
        line = (f"x{r['size']}: preparation "
                f"{r['preparing']['preparation'] / r['pairs'] * 1e6:.1f} us/pair")
        if "baseline" in r:
            line += ("; the baseline's start to exit "
                     f"{r['baseline']['exit'] / r['pairs'] * 1e6:.1f} us/pair")
        print(line)


if __name__ == "__main__":
    main()
