"""PNG plots of a training history (`history.jsonl` in the logdir)."""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kyu_transformer import filenames  # noqa: E402
from kyu_transformer.files import replaced_atomically  # noqa: E402


def read_history(path):
    """The records of a history file, the last one kept for each step (resumed runs)."""
    if not os.path.isfile(path):
        return []
    by_step = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # empty, or cut short by a crash
                continue
            by_step[(record.get("kind", "train"), record["step"])] = record
    return [by_step[key] for key in sorted(by_step)]


def plot_series(records, key, path, title, ylabel):
    """Plots `key` against the step of each record into `path` (atomically)."""
    points = [(r["step"], r[key]) for r in records if key in r]
    if not points:
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(*zip(*points), marker="o" if len(points) < 30 else None)
    axes.set(xlabel="step", ylabel=ylabel, title=title)
    axes.grid(alpha=0.3)
    return save_figure(figure, path)


def save_figure(figure, path, dpi=100):
    """Lays `figure` out, writes it to `path` (atomically) and closes it; returns `path`."""
    figure.tight_layout()
    try:
        with replaced_atomically(path) as temporary:
            figure.savefig(temporary, dpi=dpi)
    finally:
        plt.close(figure)
    return path


def plot_training(logdir):
    """Draws the `filenames.PLOTS` of `logdir` (BLEU's only when BLEU was scored)."""
    records = read_history(os.path.join(logdir, filenames.HISTORY))
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    plots = (("loss", train, "training loss", "label-smoothed cross-entropy"),
             ("lr", train, "learning rate", "lr"),
             ("bleu", evals, "validation BLEU", "BLEU"))
    drawn = [plot_series(series, key, os.path.join(logdir, filenames.PLOTS[key]), title, ylabel)
             for key, series, title, ylabel in plots]
    return [path for path in drawn if path]
