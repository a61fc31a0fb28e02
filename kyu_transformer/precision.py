"""Numeric precision of a run: the global Keras dtype policy, and `auto`'s choice of it.

``mixed_precision="auto"`` chooses for the machine at hand. On a GPU:
bfloat16 where the device computes it natively (compute capability 8.0 and
up), else float16 with loss scaling. On a CPU, bfloat16 pays only where the
processor multiplies it fast (AMX, or AVX512-BF16 units as on recent AMD
cores; elsewhere its matrix products can run at half the float32 speed), so
the choice is measured: matrix products of the model's own shapes are timed
in float32 and bfloat16 (medians of a few repeats, a fraction of a second),
and bfloat16 is taken only where it is at least `BFLOAT16_MARGIN` times faster.
A model whose products are too small for that (under `MIN_PROBE_FLOPS` in all:
the cost of launching each op, not the arithmetic, sets their time, and
bfloat16 adds casts) stays in float32 without a measurement.
"""

import statistics
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


def set_precision(mixed_precision):
    """Sets the global Keras dtype policy for ``no`` / ``bf16`` / ``fp16``.

    Layers read the policy when they are built, so it is set before the model is.
    """
    keras.config.set_dtype_policy(PRECISION_POLICIES[mixed_precision])


def choose_precision(hparams, gpus=None, timings=None):
    """``(value, reason)``: the `mixed_precision` that ``auto`` means on this machine.

    Args:
      hparams: The model's hyperparameters (`d_model`, `d_ff`, `vocab_size`:
        the shapes to time).
      gpus: ``[compute capability (major, minor)]`` of the visible GPUs;
        detected when None.
      timings: ``{"float32": s, "bfloat16": s}`` of the probe; measured when None.

    Returns:
      ``value`` is ``"no"``, ``"bf16"`` or ``"fp16"``; ``reason`` one line
      with the figures the choice was made on.
    """
    gpus = detect_gpus() if gpus is None else gpus
    if gpus:
        if all(capability >= (8, 0) for capability in gpus):
            return "bf16", f"GPU of compute capability {gpus[0][0]}.{gpus[0][1]}: native bfloat16"
        return "fp16", (f"GPU of compute capability {min(gpus)[0]}.{min(gpus)[1]}: no native "
                        "bfloat16, float16 with loss scaling")
    flops = probe_flops(hparams)
    if flops < MIN_PROBE_FLOPS:
        return "no", (f"the model's matrix products are too small for bfloat16 to pay "
                      f"({flops / 1e6:.0f} MFLOP a probe, under {MIN_PROBE_FLOPS / 1e6:.0f})")
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
    """``(k, n)`` of the model's products: attention, feed-forward in and out, output."""
    width = hparams["d_model"]
    return [(width, width), (width, hparams["d_ff"]), (hparams["d_ff"], width),
            (width, hparams["vocab_size"])]


def probe_flops(hparams):
    return sum(2 * PROBE_ROWS * k * n for k, n in probe_shapes(hparams))


def time_matmuls(hparams, repeats=5):
    """Median seconds of the model's products (`probe_shapes`), per dtype."""
    rows, shapes = PROBE_ROWS, probe_shapes(hparams)
    generator = np.random.default_rng(0)
    timings = {}
    for dtype in ("float32", "bfloat16"):
        pairs = [tuple(keras.ops.cast(generator.standard_normal(shape).astype("float32"), dtype)
                       for shape in ((rows, k), (k, n))) for k, n in shapes]
        runs = []
        for _ in range(repeats + 1):  # the first run warms the kernels up
            started = time.perf_counter()
            for left, right in pairs:
                product = keras.ops.matmul(left, right)  # (rows, n)
                keras.ops.convert_to_numpy(keras.ops.cast(product[0, 0], "float32"))  # waits
            runs.append(time.perf_counter() - started)
        timings[dtype] = statistics.median(runs[1:])
    return timings
