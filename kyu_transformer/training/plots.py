"""Draws PNG plots: a training history (`history.jsonl` in the logdir), and the cross-attention
heatmaps of eval.py's `--plot_attention`."""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kyu_transformer import filenames  # noqa: E402
from kyu_transformer.safety.writes import replaced_atomically  # noqa: E402


def read_history(path):
    """Returns the records of a history file, the last one kept for each kind and step (resumed
    runs)."""
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
    """Draws the `filenames.PLOTS` of `logdir`, each value against the step (BLEU's only when
    BLEU was scored); returns their paths."""
    records = read_history(os.path.join(logdir, filenames.HISTORY))
    plots = (("loss", "train", "training loss", "label-smoothed cross-entropy"),
             ("lr", "train", "learning rate", "lr"), ("bleu", "eval", "validation BLEU", "BLEU"))
    drawn = []
    for key, kind, title, ylabel in plots:
        points = [(r["step"], r[key]) for r in records
                  if r.get("kind", "train") == kind and key in r]
        if points:
            figure, axes = plt.subplots(figsize=(6, 4))
            axes.plot(*zip(*points), marker="o" if len(points) < 30 else None)
            axes.set(xlabel="step", ylabel=ylabel, title=title)
            axes.grid(alpha=0.3)
            drawn.append(save_figure(figure, os.path.join(logdir, filenames.PLOTS[key])))
    return drawn


def save_attention(coverage, source_pieces, output_pieces, path):
    """Saves the heatmap of one sentence's cross-attention `coverage` `(T, S)` (output pieces down,
    source pieces across) at `path`; returns `path`."""
    figure, axes = plt.subplots(figsize=(1 + 0.35 * len(source_pieces),
                                         1 + 0.35 * len(output_pieces)))
    axes.imshow(coverage[:len(output_pieces), :len(source_pieces)], cmap="viridis", aspect="auto")
    axes.set_xticks(range(len(source_pieces)), source_pieces, rotation=90)
    axes.set_yticks(range(len(output_pieces)), output_pieces)
    axes.set(xlabel="source", ylabel="output")
    return save_figure(figure, path, dpi=80)
