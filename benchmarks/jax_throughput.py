"""Training throughput on Keras' JAX backend, without TensorFlow: our Transformer against
keras-hub's, both trained by `model.fit`, in one run.

    python benchmarks/jax_throughput.py [--hparams small] [--batch 64] [--length 24]
                                        [--steps 50] [--warmup 5] [--precisions no,bf16]
                                        [--skip_peer] [--peak_tflops F32 HALF] [--json PATH]

For machines with JAX and no TensorFlow (many GPU images): nothing here imports TensorFlow, and
Keras runs on JAX whatever KERAS_BACKEND says. Our model is `Transformer.from_hparams` of an
`--hparams` preset (hparams.py); the peer is keras-hub's `TransformerEncoder` /
`TransformerDecoder` model of the same vocabulary, width, inner width, blocks and heads, with
the preset's dropout (`train_comparison.keras_hub_model`, as `train_throughput.py` builds it;
benchmarks/RESULTS.md says how to install keras-hub without TensorFlow). Both are compiled
with Keras' Adam and the project's `LabelSmoothedCrossEntropy` and fit on synthetic batches of
fixed shape (`--batch` pairs of `--length` source and target tokens, random ids, no padding):
no corpus, no tf.data.

Each model and precision (`--precisions`: the `mixed_precision` hparam's values, Keras dtype
policies) trains in a fresh process of its own, so that its peak memory is its own: the GPU's
`peak_bytes_in_use` (JAX's allocator), or on a CPU the process's peak RSS. Prints per
configuration the median target tokens/s over the timed steps (after `--warmup` steps, the
first of which compiles), the model FLOP/s (`train_comparison.training_flops`: every matrix
product, forward x 3) and the MFU against the device's dense peak from `PEAK_TFLOPS` (by
`jax.devices()[0].device_kind`; `--peak_tflops` for another device; none printed on a CPU).
"""

import argparse
import json
import multiprocessing
import os
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

# This benchmark measures Keras on JAX: set before Keras is imported, here and in each process
# that `in_fresh_process` spawns (which inherits the environment).
os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import numpy as np  # noqa: E402

from prerequisites import require  # noqa: E402  (first: it puts the checkout on sys.path)
import hparams as hparams_module  # noqa: E402
from train_comparison import keras_hub_model, training_flops  # noqa: E402

from kyu_transformer.config import HParamsError  # noqa: E402
from kyu_transformer.conventions import EOS_ID  # noqa: E402
from kyu_transformer.losses import LabelSmoothedCrossEntropy  # noqa: E402
from kyu_transformer.model import Transformer  # noqa: E402
from kyu_transformer.precision import PRECISION_POLICIES  # noqa: E402
from kyu_transformer.safety.writes import write_text  # noqa: E402

SHAPE_KEYS = ("vocab_size", "d_model", "d_ff", "num_blocks", "num_heads")
MODELS = ("ours", "keras-hub")
# Dense (no sparsity) peaks of NVIDIA GPUs in TFLOP/s, by a pattern of their lower-cased
# `device_kind` (the first that matches): float32 products, which JAX's default precision runs
# on TF32 tensor cores where the GPU has them (A100 on), and 16-bit ones: bfloat16, or float16 on
# V100 and T4, which have no bfloat16 units.
PEAK_TFLOPS = [
    (r"h200 nvl", 417.5, 835.5),
    (r"h200", 494.7, 989.4),
    (r"h100 nvl", 417.5, 835.5),
    (r"h100 pcie", 378.0, 756.5),
    (r"h100", 494.7, 989.4),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"a100", 156.0, 312.0),
    (r"\bl4\b", 60.0, 121.0),
    (r"\bt4\b", 8.1, 65.0),
    (r"v100s", 16.4, 130.0),
    (r"v100.*pcie", 14.0, 112.0),
    (r"v100", 15.7, 125.0),
]


def device_peaks(device_kind, platform, given=None):
    """Returns ``({"float32": TFLOP/s, "16-bit": TFLOP/s}, source)``: `given` (``--peak_tflops``),
    else `PEAK_TFLOPS`' row for the device; ``(None, None)`` where no peak is known."""
    if given:
        return dict(zip(("float32", "16-bit"), given)), "--peak_tflops"
    if platform == "gpu":
        for pattern, float32, half in PEAK_TFLOPS:
            if re.search(pattern, device_kind.lower()):
                return {"float32": float32, "16-bit": half}, "PEAK_TFLOPS"
    return None, None


class StepEnds(keras.callbacks.Callback):
    """Records when each training step's logs (its loss) are ready."""

    # Keras then calls it from a worker thread once the logs are computed, so that fit's loop
    # dispatches the next steps without waiting: the times are the device's, not a loop stalled.
    async_safe = True

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def synthetic_data(vocab_size, rows, length):
    """``({"source", "target_in"}, labels)``: `rows` x `length` random word ids each."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(EOS_ID + 1, vocab_size, (rows, length), dtype="int32") for _ in range(3)]
    return {"source": ids[0], "target_in": ids[1]}, ids[2]


def build_model(name, hparams):
    """Our Transformer of `hparams`, or keras-hub's model of the same shape and dropout."""
    if name == "ours":
        # Unbuilt: `fit` calls its `build()` inside `jax.eval_shape`, traced without running an
        # op; called here, it would run op by op, each op compiled by XLA on its own.
        return Transformer.from_hparams(hparams)
    return keras_hub_model({key: hparams[key] for key in SHAPE_KEYS},
                           max(hparams["maxlen1"], hparams["maxlen2"]), hparams["dropout_rate"])


def peak_memory():
    """Returns ``(bytes, what)``: the default device's peak bytes in use, or on a CPU (whose
    allocator keeps no such count) the process's peak resident set."""
    import jax  # pylint: disable=import-outside-toplevel

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"], "device"
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return kilobytes * (1 if sys.platform == "darwin" else 1024), "process RSS"


def run_configuration(name, precision, hparams, options):
    """Fits model `name` in `precision` for ``options.warmup + options.steps`` steps; returns its
    figures: the median seconds of the timed steps, its peak memory, the device."""
    import jax  # pylint: disable=import-outside-toplevel

    keras.config.set_dtype_policy(PRECISION_POLICIES[precision])
    keras.utils.set_random_seed(0)
    model = build_model(name, hparams)
    model.compile(optimizer=keras.optimizers.Adam(1e-4, beta_1=0.9, beta_2=0.98, epsilon=1e-9),
                  loss=LabelSmoothedCrossEntropy(hparams["smoothing"],
                                                 fast_paths=hparams["fast_paths"]))
    steps = options.warmup + options.steps
    features, labels = synthetic_data(hparams["vocab_size"], options.batch * steps,
                                      options.length)
    timer = StepEnds()
    history = model.fit(features, labels, batch_size=options.batch, epochs=1, shuffle=False,
                        verbose=0, callbacks=[timer])
    # Worker threads may record out of order; the steps end in order on the device.
    ends = sorted(timer.ends)
    if len(ends) != steps:
        raise RuntimeError(f"{len(ends)} steps timed of {steps}")
    seconds = statistics.median(np.diff(ends[options.warmup - 1:]))
    memory, memory_kind = peak_memory()
    device = jax.devices()[0]
    return dict(model=name, precision=precision, policy=PRECISION_POLICIES[precision],
                step_seconds=float(seconds), loss=float(history.history["loss"][-1]),
                peak_memory_bytes=int(memory), memory=memory_kind,
                device_kind=device.device_kind, platform=device.platform)


def in_fresh_process(function, *args):
    """Returns `function(*args)` run in a newly spawned Python process: its peak memory is that
    run's alone, and JAX starts there afresh (a forked JAX is unsafe)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def figures(result, flops, options, peaks):
    """Adds to a configuration's `result` its throughput, FLOP/s and MFU (None without `peaks`)."""
    result["target_tokens_per_s"] = options.batch * options.length / result["step_seconds"]
    result["tflops_per_s"] = flops / result["step_seconds"] / 1e12
    peak = peaks and peaks["float32" if result["policy"] == "float32" else "16-bit"]
    result["mfu"] = result["tflops_per_s"] / peak if peak else None
    return result


def row(result):
    """One printed line of a configuration's figures."""
    if "error" in result:
        return f"{result['model']:9s} {result['policy']:14s} failed: {result['error']}"
    mfu = "" if result["mfu"] is None else f", MFU {result['mfu']:.1%}"
    return (f"{result['model']:9s} {result['policy']:14s} median "
            f"{result['target_tokens_per_s']:10,.0f} target tokens/s "
            f"({result['step_seconds'] * 1e3:.2f} ms/step), {result['tflops_per_s']:.3f} "
            f"TFLOP/s{mfu}, peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB "
            f"({result['memory']})")


def positive(text):
    """An argument that must be a positive integer."""
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def precisions(text):
    """`--precisions`' value: a list of `mixed_precision` values."""
    values = [value.strip() for value in text.split(",")]
    for value in values:
        if value not in PRECISION_POLICIES:
            raise argparse.ArgumentTypeError(
                f"{value!r}: expected values of {', '.join(PRECISION_POLICIES)}")
    return values


def parse_args():
    """Reads the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hparams", default="small",
                        help="the models' size: a preset of hparams.py, key=value,... "
                             "(default small)")
    parser.add_argument("--batch", type=positive, default=64, help="sentence pairs a step")
    parser.add_argument("--length", type=positive, default=24,
                        help="source and target tokens of each pair")
    parser.add_argument("--steps", type=positive, default=50, help="timed steps")
    parser.add_argument("--warmup", type=positive, default=5,
                        help="steps before the timed ones (the first compiles)")
    parser.add_argument("--precisions", type=precisions, default=["no", "bf16"],
                        help="mixed_precision values to time, comma-separated: "
                             f"{', '.join(PRECISION_POLICIES)} (default no,bf16)")
    parser.add_argument("--skip_peer", action="store_true", help="time our model alone")
    parser.add_argument("--peak_tflops", type=float, nargs=2, metavar=("F32", "HALF"),
                        help="the device's dense peaks in TFLOP/s, of float32 products (TF32 "
                             "where used) and of 16-bit ones, for a device PEAK_TFLOPS lacks")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    return parser.parse_args()


def model_hparams(args):
    """The hparams of `--hparams`; stops with one line if they are wrong or `--length` is over
    the model's position tables."""
    try:
        hparams = hparams_module.parse(args.hparams)
    except HParamsError as error:
        sys.exit(f"error: {error}")
    longest = min(hparams["maxlen1"], hparams["maxlen2"])
    if args.length > longest:
        sys.exit(f"error: --length {args.length} is over the model's maxlen1/maxlen2 "
                 f"({longest}); raise them in --hparams")
    return hparams


def run_all(args, hparams):
    """Runs every configuration, each in a fresh process; prints each one's line as it ends.
    Returns the results and the device's peaks (and their source)."""
    flops = training_flops({key: hparams[key] for key in SHAPE_KEYS}, args.batch, args.length,
                           args.length)
    models = MODELS[:1] if args.skip_peer else MODELS
    results, peaks = [], (None, None)
    for precision in args.precisions:
        for name in models:
            try:
                result = in_fresh_process(run_configuration, name, precision, hparams, args)
            except Exception as error:  # pylint: disable=broad-except  # say it, time the rest
                first_line = (str(error).splitlines() or [""])[0]
                result = dict(model=name, precision=precision,
                              policy=PRECISION_POLICIES[precision],
                              error=f"{type(error).__name__}: {first_line}")
            else:
                peaks = device_peaks(result["device_kind"], result["platform"], args.peak_tflops)
                figures(result, flops, args, peaks[0])
            results.append(result)
            print(row(result), flush=True)
    return results, peaks, flops


def main():
    """Times every configuration, prints the figures and the ratios, writes --json."""
    args = parse_args()
    hparams = model_hparams(args)
    if not args.skip_peer:
        require("keras_hub", hint=" (or --skip_peer; without TensorFlow: see "
                                  "benchmarks/RESULTS.md)")
    shape = {key: hparams[key] for key in SHAPE_KEYS}
    results, (peaks, peak_source), flops = run_all(args, hparams)
    done = [result for result in results if "error" not in result]
    device = done[0]["device_kind"] if done else "unknown"
    print(f"\nhparams {args.hparams}: {shape}, batch {args.batch} x {args.length}/{args.length} "
          f"tokens, {flops / 1e9:.1f} GFLOP per training step; {args.warmup} warm-up and "
          f"{args.steps} timed steps a configuration")
    print(f"device: {device}; " + (f"peaks {peaks['float32']} TFLOP/s float32, "
                                   f"{peaks['16-bit']} 16-bit ({peak_source})" if peaks
                                   else "no MFU: its peak is unknown (give --peak_tflops)"))
    rates = {(r["model"], r["precision"]): r["target_tokens_per_s"] for r in done}
    ratios = {precision: rates[("ours", precision)] / rates[("keras-hub", precision)]
              for precision in args.precisions
              if ("ours", precision) in rates and ("keras-hub", precision) in rates}
    for precision, ratio in ratios.items():
        print(f"ratio ours / keras-hub, {PRECISION_POLICIES[precision]}: {ratio:.2f}x")
    if args.json:
        write_text(args.json, json.dumps(dict(
            device_kind=device, hparams=args.hparams, shape=shape, batch=args.batch,
            length=args.length, warmup=args.warmup, steps=args.steps, flops_per_step=flops,
            peak_tflops=peaks, peak_source=peak_source, results=results, ratios=ratios),
            indent=2) + "\n")
    if len(done) < len(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
