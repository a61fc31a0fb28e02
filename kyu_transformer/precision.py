"""Sets a run's numeric precision, the global Keras dtype policy, and makes `auto`'s choice of it.

On a CPU bfloat16 pays only with fast units (AMX, AVX512-BF16), so ``auto`` times the model's
matrix products in both dtypes. On a GPU its compute capability decides: bfloat16 from 8.0,
float16 from 7.0 (tensor cores), float32 below, where float16 arithmetic gains no speed. Keras
(and TensorFlow) loads only to set a policy or time them.
"""

import time

import numpy as np

# The `mixed_precision` hparam's values and the Keras dtype policies they name.
PRECISION_POLICIES = {"no": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
AUTO = "auto"
# GPUs of at least these compute capabilities multiply in bfloat16 / float16 on tensor cores.
NATIVE_BFLOAT16 = (8, 0)
TENSOR_CORES = (7, 0)
# Below this speedup, the casts and float32 parts of a mixed step eat bfloat16's gain.
BFLOAT16_MARGIN = 1.2
PROBE_ROWS = 512  # rows of the probe's products: tokens of a small batch
MIN_PROBE_FLOPS = 2**28  # smaller models stay float32: op launches, not arithmetic, set the time
RUNS_PER_PRODUCT = 4  # a repeat runs each product at most this often, scaled to its count


def set_precision(mixed_precision):
    """Sets the global Keras dtype policy for ``no`` / ``bf16`` / ``fp16`` (before the model)."""
    import keras  # pylint: disable=import-outside-toplevel

    keras.config.set_dtype_policy(PRECISION_POLICIES[mixed_precision])


def choose_precision(hparams, gpus=None, timings=None):
    """Chooses the `mixed_precision` that ``auto`` means here; returns ``(value, reason)``, the
    reason one line with the figures it was chosen on. `gpus` (``[(major, minor)]`` compute
    capabilities) and `timings` (``{"float32": s, "bfloat16": s}``) are detected or measured when
    None."""
    flops = probe_flops(hparams)
    if flops < MIN_PROBE_FLOPS:  # on any device
        return "no", ("the model's matrix products are too small for a half-precision type to "
                      f"pay ({flops / 1e6:.0f} MFLOP a probe, under {MIN_PROBE_FLOPS / 1e6:.0f})")
    gpus = detect_gpus() if gpus is None else gpus
    if gpus:
        return choose_gpu_precision(min(gpus))  # the weakest GPU sets every replica's pace
    timings = timings or time_matmuls(hparams)
    speedup = timings["float32"] / timings["bfloat16"]
    value = "bf16" if speedup >= BFLOAT16_MARGIN else "no"
    return value, (f"CPU matrix products of the model's shapes: float32 "
                   f"{timings['float32'] * 1e3:.1f} ms, bfloat16 {timings['bfloat16'] * 1e3:.1f} "
                   f"ms ({speedup:.2f}x; bfloat16 needs {BFLOAT16_MARGIN}x)")


def choose_gpu_precision(capability):
    """Returns ``(value, reason)`` for GPUs of compute capability `capability` (``(major,
    minor)``): bfloat16 where native, float16 with tensor cores, else float32."""
    named = f"GPU of compute capability {capability[0]}.{capability[1]}"
    if capability >= NATIVE_BFLOAT16:
        return "bf16", f"{named}: native bfloat16"
    if capability >= TENSOR_CORES:
        return "fp16", f"{named}: no native bfloat16, float16 with loss scaling"
    return "no", (f"{named}: no tensor cores (from {TENSOR_CORES[0]}.{TENSOR_CORES[1]}), "
                  "float16 would gain no speed over float32")


def scales_the_loss(value, hparams):
    """Returns whether a run of `mixed_precision` `value` has float16's loss-scale optimizer (whose
    state other precisions lack): ``fp16``, or ``auto`` where it chooses float16 (a GPU with tensor
    cores and without native bfloat16)."""
    if value != AUTO:
        return value == "fp16"
    gpus = detect_gpus()
    return bool(gpus) and choose_precision(hparams, gpus)[0] == "fp16"


def resolve_precision(value, hparams, log=print):
    """Returns `value`, or the choice of ``auto`` on this machine (said in one line through
    `log`)."""
    if value != AUTO:
        return value
    chosen, reason = choose_precision(hparams)
    log(f"mixed_precision auto: {chosen} ({reason})")
    return chosen


def detect_gpus():
    """Returns the compute capabilities of the visible GPUs (TensorFlow's view; [] elsewhere)."""
    return [capability for _, capability in gpu_details()]


def gpu_details():
    """Returns ``(name, (major, minor) compute capability)`` of each visible GPU in TensorFlow's
    order ([] without TensorFlow); a detail the driver does not give reads ``"unnamed GPU"`` and
    ``(0, 0)``."""
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    except ImportError:
        return []
    details = [tf.config.experimental.get_device_details(device)
               for device in tf.config.list_physical_devices("GPU")]
    return [(detail.get("device_name", "unnamed GPU"),
             tuple(detail.get("compute_capability", (0, 0)))) for detail in details]


def probe_shapes(hparams):
    """Returns ``(k, n, count)`` for the model's products: their shapes and how many a forward
    pass makes of each: attention projections (4 per encoder block, 8 per decoder block),
    feed-forward, output."""
    width, inner, blocks = hparams["d_model"], hparams["d_ff"], hparams["num_blocks"]
    return [(width, width, 12 * blocks), (width, inner, 2 * blocks),
            (inner, width, 2 * blocks), (width, hparams["vocab_size"], 1)]


def probe_flops(hparams):
    """Returns the floating-point operations of the products `probe_shapes` weighs, on
    PROBE_ROWS rows."""
    return sum(2 * PROBE_ROWS * k * n * count for k, n, count in probe_shapes(hparams))


def time_matmuls(hparams, repeats=5):
    """Times the products `probe_shapes` weighs; returns their seconds per dtype, the fastest of
    `repeats`, as interference only slows a repeat down (a median of few flips near the margin)."""
    import keras  # pylint: disable=import-outside-toplevel

    rows, shapes = PROBE_ROWS, probe_shapes(hparams)
    generator, timings = np.random.default_rng(0), {}
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
