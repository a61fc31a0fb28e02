"""Numeric precision of a run: the global Keras dtype policy, and `auto`'s choice of it.

``mixed_precision="auto"`` chooses for the machine at hand. On a GPU:
bfloat16 where the device computes it natively (compute capability 8.0 and
up), else float16 with loss scaling. On a CPU, bfloat16 pays only where the
processor multiplies it fast (AMX, or AVX512-BF16 units as on recent AMD
cores; elsewhere its matrix products can run at half the float32 speed), so
the choice is measured: matrix products of the model's own shapes are timed
in float32 and bfloat16 (the fastest of a few repeats, a fraction of a second),
and bfloat16 is taken only where it is at least `BFLOAT16_MARGIN` times faster.
A model whose products are too small for that (under `MIN_PROBE_FLOPS` in all:
the cost of launching each op, not the arithmetic, sets their time, and
bfloat16 adds casts) stays in float32 without a measurement.
"""

import time

import keras
import numpy as np

# The `mixed_precision` hparam's values and the Keras dtype policies they name.
PRECISION_POLICIES = {"no": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
AUTO = "auto"
# How much faster bfloat16 products must be to be chosen: below it, the casts and
# the float32 parts of a mixed step eat the gain.
BFLOAT16_MARGIN = 1.2
PROBE_ROWS = 512  # rows of the probe's products: tokens of a small batch
MIN_PROBE_FLOPS = 2**28
RUNS_PER_PRODUCT = 4


def set_precision(mixed_precision):
    """Sets the global Keras dtype policy for ``no`` / ``bf16`` / ``fp16``.

    Layers read the policy when they are built, so it is set before the model is.
    """
    keras.config.set_dtype_policy(PRECISION_POLICIES[mixed_precision])


def choose_precision(hparams, gpus=None, timings=None):
    """``(value, reason)``: the `mixed_precision` that ``auto`` means on this machine.

    Args:
      hparams: The model's hyperparameters (`d_model`, `d_ff`, `num_blocks`,
        `vocab_size`: the shapes to time).
      gpus: ``[compute capability (major, minor)]`` of the visible GPUs;
        detected when None.
      timings: ``{"float32": s, "bfloat16": s}`` of the probe; measured when None.

    Returns:
      ``value`` is ``"no"``, ``"bf16"`` or ``"fp16"``; ``reason`` one line
      with the figures the choice was made on.
    """
    flops = probe_flops(hparams)
    if flops < MIN_PROBE_FLOPS:  # on any device: launching ops, not arithmetic, sets the time
        return "no", (f"the model's matrix products are too small for a half-precision type "
                      f"to pay ({flops / 1e6:.0f} MFLOP a probe, under "
                      f"{MIN_PROBE_FLOPS / 1e6:.0f})")
    gpus = detect_gpus() if gpus is None else gpus
    if gpus:
        if all(capability >= (8, 0) for capability in gpus):
            return "bf16", f"GPU of compute capability {gpus[0][0]}.{gpus[0][1]}: native bfloat16"
        return "fp16", (f"GPU of compute capability {min(gpus)[0]}.{min(gpus)[1]}: no native "
                        "bfloat16, float16 with loss scaling")
    timings = timings or time_matmuls(hparams)
    speedup = timings["float32"] / timings["bfloat16"]
    value = "bf16" if speedup >= BFLOAT16_MARGIN else "no"
    return value, (f"CPU matrix products of the model's shapes: float32 "
                   f"{timings['float32'] * 1e3:.1f} ms, bfloat16 {timings['bfloat16'] * 1e3:.1f} "
                   f"ms ({speedup:.2f}x; bfloat16 needs {BFLOAT16_MARGIN}x)")


def resolve_precision(value, hparams, log=print):
    """`value`, or the choice of ``auto`` on this machine (said in one line through `log`)."""
    if value != AUTO:
        return value
    chosen, reason = choose_precision(hparams)
    log(f"mixed_precision auto: {chosen} ({reason})")
    return chosen


def detect_gpus():
    """The compute capabilities of the visible GPUs (TensorFlow's view; [] elsewhere)."""
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    except ImportError:
        return []
    details = [tf.config.experimental.get_device_details(device)
               for device in tf.config.list_physical_devices("GPU")]
    return [tuple(detail.get("compute_capability", (0, 0))) for detail in details]


def probe_shapes(hparams):
    """``(k, n, count)`` of the model's products and how many a forward pass makes of each.

    Attention projections (query, key, value, output: 4 in an encoder block,
    8 in a decoder block), the feed-forward's two, and the output layer's one:
    weighted so, the probe stands for a step, not for its largest product.
    """
    width, inner, blocks = hparams["d_model"], hparams["d_ff"], hparams["num_blocks"]
    return [(width, width, 12 * blocks), (width, inner, 2 * blocks),
            (inner, width, 2 * blocks), (width, hparams["vocab_size"], 1)]


def probe_flops(hparams):
    """Floating-point operations of the products `probe_shapes` weighs, on PROBE_ROWS rows."""
    return sum(2 * PROBE_ROWS * k * n * count for k, n, count in probe_shapes(hparams))


def time_matmuls(hparams, repeats=5):
    """Seconds of the products `probe_shapes` weighs (the fastest of `repeats`), per dtype.

    The fastest, not the median: interference (another process, the first
    calls of a kernel) only ever slows a repeat down, and near the margin a
    median of few repeats flips from one process to the next.
    A repeat runs each product as often as a step makes it, up to `RUNS_PER_PRODUCT`
    times (its time then counts for the rest): timed runs of a few milliseconds,
    long enough not to be noise, and a probe of a fraction of a second.
    """
    rows, shapes = PROBE_ROWS, probe_shapes(hparams)
    generator = np.random.default_rng(0)
    timings = {}
    for dtype in ("float32", "bfloat16"):
        pairs = [tuple(keras.ops.cast(generator.standard_normal(shape).astype("float32"), dtype)
                       for shape in ((rows, k), (k, n))) for k, n, _ in shapes]
        runs = []
        for _ in range(repeats + 1):  # the first run warms the kernels up
            run = 0.0
            for (left, right), (_, _, count) in zip(pairs, shapes):
                runs_of_it = min(count, RUNS_PER_PRODUCT)
                started = time.perf_counter()
                for _ in range(runs_of_it):
                    product = keras.ops.matmul(left, right)  # (rows, n)
                    keras.ops.convert_to_numpy(keras.ops.cast(product[0, 0], "float32"))  # waits
                run += (time.perf_counter() - started) * count / runs_of_it
            runs.append(run)
        timings[dtype] = min(runs[1:])
    return timings
