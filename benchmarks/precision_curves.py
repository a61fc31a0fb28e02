"""Training-loss curves of the `small` preset on Multi30k in float32 and in bfloat16, on one plot.

    python benchmarks/precision_curves.py [--epochs 2] [--out docs/precision_loss.png]
        [--reuse_bf16 log/small]

Runs train.py twice with the same hyperparameters, seed and batches for --epochs, once per
precision (or takes the bf16 curve from the history of an existing run of the
same preset with --reuse_bf16), then plots both loss curves and prints the
losses at the end and the tokens/s of each.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from prerequisites import DEFAULT_DATA, ROOT, require_data  # noqa: E402

from kyu_transformer.training.plots import plt, read_history  # noqa: E402


def train(logdir, precision, epochs, data_dir):
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--hparams", "small",
               "--data_dir", data_dir, "--logdir", logdir, "--mixed_precision", precision,
               "--num_epochs", str(epochs), "--max_minutes", "0",
               "--eval_sentences", "0", "--log_every", "10", "--checkpoint_every", "0"]
    subprocess.run(command, check=True, cwd=ROOT,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, stdout=subprocess.DEVNULL)
    return history(logdir, epochs)


def history(logdir, epochs):
    return [r for r in read_history(os.path.join(logdir, "history.jsonl"))
            if r.get("kind", "train") == "train" and r["epoch"] <= epochs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "precision_loss.png"))
    parser.add_argument("--reuse_bf16", default=None, help="logdir of a bf16 run of `small`")
    args = parser.parse_args()
    require_data(args.data_dir)
    scratch = tempfile.mkdtemp(prefix="precision-")
    curves = {"float32": train(os.path.join(scratch, "fp32"), "no", args.epochs, args.data_dir)}
    curves["bfloat16"] = (history(args.reuse_bf16, args.epochs) if args.reuse_bf16 else
                          train(os.path.join(scratch, "bf16"), "bf16", args.epochs,
                                args.data_dir))
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, records in curves.items():
        axes.plot([r["step"] for r in records], [r["loss"] for r in records], label=name)
        speed = sorted(r["tokens_per_sec"] for r in records[1:])
        print(f"{name:9s} loss at step {records[-1]['step']}: {records[-1]['loss']:.4f}; "
              f"median {speed[len(speed) // 2]:.0f} target tokens/s")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title("small preset on Multi30k: float32 vs bfloat16")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    figure.savefig(args.out, dpi=100)
    print(f"plot: {args.out}")
    print(json.dumps({name: [round(r["loss"], 4) for r in records]
                      for name, records in curves.items()}))


if __name__ == "__main__":
    main()
