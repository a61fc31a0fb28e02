"""Training throughput (target tokens/s) of our Transformer against keras-hub's, in one run.

    python benchmarks/train_throughput.py [--repeats 3] [--steps 20] [--variants fp32,bf16]
                                          [--baseline REV] [--shape d_model=512,num_blocks=6]
                                          [--peak_tflops F32 HALF]

Both models: d_model 256, d_ff 1024, 3 encoder + 3 decoder blocks, 4 heads,
vocabulary 8000 (`--shape` changes any of these), trained on the same fixed
batch (64 pairs, 24 source and 24 target tokens, no padding) by the same step
function (Adam, label-smoothed cross-entropy; the peer with `jit_compile`, ours
as --variants says). Each trains as its users would: the peer with Keras' Adam,
ours as the trainer does, with its Adam (`kyu_transformer.training.optimizer.Adam`, the
same update in one fused kernel; `--keras_adam` gives ours Keras' Adam) and its
loss compiled alone with XLA (`training.step.loss_terms_function`; `--no_xla_loss`
leaves it to TensorFlow's kernels, as the rest of the step). The peer is built
from keras-hub's `TokenAndPositionEmbedding`, `TransformerEncoder` and
`TransformerDecoder` (install with `pip install -e .[bench]`).

Repetitions take turns (each times every configuration once, so that the
machine's drifts in speed reach all alike). With `--baseline REV`, our model
as the package stood at git revision REV (say, the commit before a change)
trains in the same process and turns, so that a change is measured against
the same peer timings rather than across processes. Prints each repetition,
the medians, their ratios, and the model FLOP utilisation against a
matrix-multiply peak measured in the same run (or the peaks `--peak_tflops` gives: a
datasheet's, or none measured where the figures' MFU does not matter).
"""

import argparse
import contextlib
import importlib
import os
import re
import statistics
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from prerequisites import in_turns, require, tree_at  # noqa: E402
from train_comparison import keras_hub_model, training_flops  # noqa: E402

from kyu_transformer.losses import LabelSmoothedCrossEntropy  # noqa: E402
from kyu_transformer.model import Transformer  # noqa: E402
from kyu_transformer.precision import choose_precision  # noqa: E402
from kyu_transformer.training.optimizer import Adam  # noqa: E402
from kyu_transformer.training.step import loss_terms_function  # noqa: E402

# The units a training step takes from our package (`package_at` gives an earlier one's).
CURRENT = SimpleNamespace(Transformer=Transformer, Adam=Adam,
                          loss_terms_function=loss_terms_function,
                          LabelSmoothedCrossEntropy=LabelSmoothedCrossEntropy)

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16"}  # --variants' dtype policies
SHAPE = dict(vocab_size=8000, d_model=256, d_ff=1024, num_blocks=3, num_heads=4)
BATCH, SOURCE_LEN, TARGET_LEN = 64, 24, 24


def ours(package=CURRENT):
    return package.Transformer(**SHAPE, maxlen1=64, maxlen2=64, dropout_rate=0.1, name="ours")


def package_at(revision):
    """Our package as it stood at git `revision`, importable beside the current one.

    Its files are extracted with `git archive` into a temporary folder
    (removed when the process ends) under another name (every
    `kyu_transformer` in them renamed), so that both versions live in one
    process, each with its own model, Adam and loss.
    """
    name = "kyu_transformer_at_" + re.sub(r"\W", "_", revision)
    folder = tree_at(revision, "kyu_transformer")
    os.rename(os.path.join(folder, "kyu_transformer"), os.path.join(folder, name))
    for directory, _, files in os.walk(os.path.join(folder, name)):
        for file_name in files:
            if file_name.endswith(".py"):
                path = os.path.join(directory, file_name)
                with open(path) as source:
                    text = re.sub(r"\bkyu_transformer\b", name, source.read())
                with open(path, "w") as source:
                    source.write(text)
    sys.path.insert(0, folder)

    def module(*units):
        """The first of `units` that the revision has (each name the module had in turn)."""
        for unit in units[:-1]:
            with contextlib.suppress(ModuleNotFoundError):
                return importlib.import_module(f"{name}.{unit}")
        return importlib.import_module(f"{name}.{units[-1]}")

    # The step's loss lived in training.py, then train_step.py, now training/step.py (0.2.0).
    step = module("training.step", "train_step", "training")
    return SimpleNamespace(Transformer=module("model").Transformer,
                           Adam=module("training.optimizer", "optimizers").Adam,
                           loss_terms_function=step.loss_terms_function,
                           LabelSmoothedCrossEntropy=module("losses").LabelSmoothedCrossEntropy)


def batch():
    rng = np.random.default_rng(0)
    features = {"source": rng.integers(4, SHAPE["vocab_size"], (BATCH, SOURCE_LEN), "int32"),
                "target_in": rng.integers(4, SHAPE["vocab_size"], (BATCH, TARGET_LEN), "int32")}
    labels = rng.integers(4, SHAPE["vocab_size"], (BATCH, TARGET_LEN), "int32")
    return features, labels


def make_step(model, jit_compile, optimizer_class, xla_loss=False, package=CURRENT):
    """A training step; `xla_loss`: the loss compiled apart, as the trainer does.

    `package`: where the loss comes from (the current package, or `package_at`'s).
    """
    optimizer = optimizer_class(1e-4, beta_1=0.9, beta_2=0.98, epsilon=1e-9)
    # Its variables made now, as the trainer makes them: made while the step is traced, each
    # one is a variable-capturing scope of its own (seconds for a model's few hundred).
    optimizer.build(model.trainable_variables)
    loss_terms = package.loss_terms_function(package.LabelSmoothedCrossEntropy(0.1), xla=xla_loss)

    # No AutoGraph, as the trainer's step: it has no Python control flow to convert.
    @tf.function(jit_compile=jit_compile, autograph=False)
    def step(features, labels):
        with tf.GradientTape() as tape:
            loss_sum, _, tokens = loss_terms(labels, model(features, training=True))
            loss = loss_sum / tf.maximum(tokens, 1.0)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return step


def matmul_peak(dtype, size=2048, repeats=20):
    """FLOP/s of `repeats` chained products of `size` x `size` matrices, at the fastest of three
    calls after one to warm up: products this large keep the cores' vector units busy, and a
    chain of twenty lasts long enough that a call's own cost does not count (with five, bfloat16
    read 1 to 2% low on a processor with AMX)."""
    a = tf.random.normal((size, size), dtype=tf.float32)
    a = tf.cast(a, dtype)

    @tf.function
    def chain(x):
        for _ in range(repeats):
            x = tf.matmul(x, a) * tf.cast(1e-3, dtype)
        return x

    chain(a).numpy()
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        chain(a).numpy()
        timings.append(time.perf_counter() - started)
    return 2 * size ** 3 * repeats / min(timings)


def matmul_peaks(given, dtypes):
    """Returns ``({dtype: FLOP/s}, source)`` for float32 and, where a configuration computes in
    it, bfloat16: `given` (``--peak_tflops``, in TFLOP/s), else measured by `matmul_peak`."""
    wanted = ["float32"] + (["bfloat16"] if "bfloat16" in dtypes else [])
    if given:
        return {dtype: given[index] * 1e12 for index, dtype in enumerate(wanted)}, "given"
    return {dtype: matmul_peak(getattr(tf, dtype)) for dtype in wanted}, "measured"


def measure(steps_by_name, features, labels, steps, repeats, warmup=3):
    """Target tokens/s of each step function, per repetition, timed in turns.

    Each repetition times every configuration once, one after the other, so
    that the machine's drifts in speed reach all of them alike; every other
    repetition in reverse order, so that no configuration always runs right
    after the same one.
    """
    for step in steps_by_name.values():
        for _ in range(warmup):
            step(features, labels).numpy()
    rates = {name: [] for name in steps_by_name}
    for repeat in range(repeats):
        for name, step in in_turns(steps_by_name.items(), repeat):
            started = time.perf_counter()
            for _ in range(steps):
                loss = step(features, labels)
            loss.numpy()
            seconds = time.perf_counter() - started
            rates[name].append(BATCH * TARGET_LEN * steps / seconds)
            print(f"  {name:16s} repeat {repeat + 1}: {rates[name][-1]:8.0f} target tokens/s "
                  f"({seconds / steps * 1000:.0f} ms/step)", flush=True)
    return rates


def shape_flag(text):
    """`--shape`'s value: SHAPE with the ``KEY=INTEGER,...`` of `text` in place of its own."""
    shape = dict(SHAPE)
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in SHAPE or not value.isdecimal() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=N (N a positive integer, KEY one of {', '.join(SHAPE)})")
        shape[key] = int(value)
    if shape["d_model"] % shape["num_heads"]:
        raise argparse.ArgumentTypeError(f"{text!r}: d_model ({shape['d_model']}) must be a "
                                         f"multiple of num_heads ({shape['num_heads']})")
    if shape["vocab_size"] <= 4:
        raise argparse.ArgumentTypeError(f"{text!r}: vocab_size ({shape['vocab_size']}) must "
                                         "be over 4, the special ids")
    return shape


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="fp32,bf16",
                        help="our configurations, comma-separated: fp32, bf16, fp32-xla, "
                             "bf16-xla (the peer always runs fp32 with XLA)")
    parser.add_argument("--skip_peer", action="store_true")
    parser.add_argument("--keras_adam", action="store_true",
                        help="train ours with Keras' Adam instead of the trainer's fused one")
    parser.add_argument("--no_xla_loss", action="store_true",
                        help="leave our loss uncompiled (the trainer's xla_loss=false)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time our model as it stood at git revision REV, in the "
                             "same process and turns (configurations named at-REV-fp32, ...)")
    parser.add_argument("--shape", type=shape_flag, default=SHAPE, metavar="KEY=N,...",
                        help=f"both models' shape, changed from {SHAPE}")
    parser.add_argument("--peak_tflops", type=float, nargs=2, metavar=("F32", "HALF"),
                        help="the device's dense peaks in TFLOP/s, of float32 products (TF32 "
                             "where used) and of bfloat16 ones, for the MFU, instead of the "
                             "peaks measured")
    args = parser.parse_args()
    if args.peak_tflops and min(args.peak_tflops) <= 0:
        parser.error("--peak_tflops: expected two peaks over 0, not {} and {}".format(
            *args.peak_tflops))
    return args


def make_steps(args):
    """Returns ``(steps, compute dtypes)``, by configuration name: the peer's (unless
    --skip_peer), then ours and --baseline's in each of --variants."""
    steps_by_name = {}
    dtypes = {"keras-hub": "float32"}  # each configuration's compute dtype, for its peak
    if not args.skip_peer:
        keras.config.set_dtype_policy("float32")
        keras.utils.set_random_seed(0)
        steps_by_name["keras-hub"] = make_step(keras_hub_model(SHAPE, 64, 0.1), True,
                                               keras.optimizers.Adam)
    packages = {"ours": CURRENT}
    if args.baseline:
        packages[baseline_label(args)] = package_at(args.baseline)
    for variant in args.variants.split(","):
        dtype, _, compiler = variant.partition("-")
        for label, package in packages.items():
            policy = keras.DTypePolicy(POLICIES[dtype])
            dtypes[f"{label}-{variant}"] = policy.compute_dtype
            keras.config.set_dtype_policy(policy)
            keras.utils.set_random_seed(0)
            model = ours(package)
            model.build()
            optimizer_class = keras.optimizers.Adam if args.keras_adam else package.Adam
            steps_by_name[f"{label}-{variant}"] = make_step(
                model, compiler == "xla", optimizer_class, xla_loss=not args.no_xla_loss,
                package=package)
    keras.config.set_dtype_policy("float32")
    return steps_by_name, dtypes


def baseline_label(args):
    """The name of --baseline's configurations' package."""
    return f"at-{args.baseline}"


def report(args, rates, dtypes):
    """Prints the shape, the peaks, each configuration's median rate and MFU, and the
    ratios to the peer and (paired, repetition by repetition) to --baseline."""
    results = {name: statistics.median(values) for name, values in rates.items()}
    flops = training_flops(SHAPE, BATCH, SOURCE_LEN, TARGET_LEN)
    peaks, source = matmul_peaks(args.peak_tflops, set(dtypes.values()))
    print(f"\nshape: {SHAPE}, batch {BATCH} x {SOURCE_LEN}/{TARGET_LEN} tokens, "
          f"{flops / 1e9:.1f} GFLOP per training step")
    for dtype, peak in peaks.items():
        print(f"{source} {dtype} matmul peak: {peak / 1e9:.0f} GFLOP/s")
    chosen, reason = choose_precision(SHAPE)
    configuration = {"bf16": "ours-bf16", "no": "ours-fp32"}.get(chosen, "not measured here")
    print(f"mixed_precision auto picks {chosen} here ({reason}): {configuration}")
    for name, rate in results.items():
        peak = peaks[dtypes[name]]
        achieved = rate / (BATCH * TARGET_LEN) * flops
        print(f"{name:16s} median {rate:8.0f} target tokens/s, {achieved / 1e9:6.0f} GFLOP/s, "
              f"MFU {achieved / peak:.0%}")
    if "keras-hub" in results:
        for name, rate in results.items():
            if name != "keras-hub":
                print(f"ratio {name} / keras-hub: {rate / results['keras-hub']:.2f}x")
    if args.baseline:
        label = baseline_label(args)
        for variant in args.variants.split(","):
            paired = [ours_rate / baseline_rate for ours_rate, baseline_rate
                      in zip(rates[f"ours-{variant}"], rates[f"{label}-{variant}"])]
            print(f"ratio ours-{variant} / {label}-{variant}: "
                  f"{statistics.median(paired):.3f}x (median over the repetitions)")


def main():
    args = parse_args()
    SHAPE.update(args.shape)
    if not args.skip_peer:
        require("keras_hub")
    features, labels = batch()
    steps_by_name, dtypes = make_steps(args)
    report(args, measure(steps_by_name, features, labels, args.steps, args.repeats), dtypes)


if __name__ == "__main__":
    main()
