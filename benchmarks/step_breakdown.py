"""Where the time of a training step goes, at the benchmark shape of train_throughput.py.

    python benchmarks/step_breakdown.py [--policy float32|mixed_bfloat16] [--trace DIR]

Times (median of --repeats runs of --steps calls, each a compiled tf.function):
the encoder forward; the whole forward (logits); forward + loss + gradients; the
full step with the Adam update; and the full step fed by the real tf.data
pipeline on Multi30k (batches of the `small` preset) against the same batches
held in memory, which shows whether the input pipeline slows training.
With --trace, also writes a TensorFlow profiler trace of 5 full steps (open
it in TensorBoard's profile tab) for the op-by-op view.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from prerequisites import DEFAULT_DATA, ROOT, require_data  # noqa: E402
from train_throughput import BATCH, TARGET_LEN, batch, make_step, ours  # noqa: E402

import hparams as hp  # noqa: E402
from kyu_transformer.data.corpus import Corpus  # noqa: E402
from kyu_transformer.losses import LabelSmoothedCrossEntropy  # noqa: E402
from kyu_transformer.training.optimizer import Adam  # noqa: E402
from kyu_transformer.training.step import loss_terms_function  # noqa: E402


def timed(function, arguments, steps, repeats):
    function(*arguments)  # trace and warm up
    function(*arguments)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            result = function(*arguments)
        tf.nest.map_structure(lambda t: t.numpy(), result)
        runs.append((time.perf_counter() - started) / steps)
    return statistics.median(runs)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--trace", default=None)
    return parser.parse_args()


def time_the_parts(model, step, args):
    """Prints the median time of each part of a step on the benchmark's batch: the encoder,
    the forward pass, forward + loss + gradients, and the full `step`."""
    loss_terms = loss_terms_function(LabelSmoothedCrossEntropy(0.1))
    features, labels = batch()

    @tf.function
    def encoder(features):
        return model.encode(features["source"], training=True)[0]

    @tf.function
    def forward(features):
        return model(features, training=True)

    @tf.function
    def gradients(features, labels):
        with tf.GradientTape() as tape:
            loss_sum, _, tokens = loss_terms(labels, model(features, training=True))
            loss = loss_sum / tokens
        return tape.gradient(loss, model.trainable_variables)

    rows = [("encoder forward", timed(encoder, (features,), args.steps, args.repeats)),
            ("forward (logits)", timed(forward, (features,), args.steps, args.repeats)),
            ("forward + loss + gradients", timed(gradients, (features, labels), args.steps,
                                                 args.repeats)),
            ("full step (+ Adam update)", timed(step, (features, labels), args.steps,
                                                args.repeats))]
    print(f"policy {args.policy}, batch {BATCH} x {TARGET_LEN} target tokens:")
    for name, seconds in rows:
        print(f"  {name:28s} {seconds * 1000:7.1f} ms")


def time_the_pipeline(step, args):
    """Prints `step`'s rate on the `small` preset's Multi30k batches held in memory and read
    from tf.data."""
    hparams = hp.parse("small", {"mixed_precision": "no"})
    corpus = Corpus(args.data_dir, os.path.join(ROOT, "log", ".breakdown"), hparams,
                    log=lambda line: None)
    count = args.steps * args.repeats
    # The first batch of an epoch waits for the pipeline to start (its plan, its reads
    # ahead), once per epoch: it is fetched before the clocks start, in both passes.
    held = [(f, l) for f, l in corpus.train_batches(0).take(count + 1)][1:]
    tokens = sum(int(tf.reduce_sum(tf.cast(l != 0, tf.int32))) for _, l in held)
    for features, labels in held:
        step(features, labels)  # trace every shape before timing
    started = time.perf_counter()
    for features, labels in held:
        step(features, labels).numpy()
    in_memory = time.perf_counter() - started
    iterator = iter(corpus.train_batches(0).take(count + 1))
    next(iterator)
    started = time.perf_counter()
    for features, labels in iterator:
        step(features, labels).numpy()
    piped = time.perf_counter() - started
    print(f"real Multi30k batches of the small preset ({count} steps, {tokens} target tokens):")
    print(f"  held in memory      {in_memory / count * 1000:7.1f} ms/step, "
          f"{tokens / in_memory:6.0f} target tokens/s")
    print(f"  from tf.data        {piped / count * 1000:7.1f} ms/step, "
          f"{tokens / piped:6.0f} target tokens/s")


def main():
    args = parse_args()
    require_data(args.data_dir)
    keras.config.set_dtype_policy(args.policy)
    model = ours()
    model.build()
    # The full step, as train_throughput.py times it (the trainer's Adam and XLA loss).
    step = make_step(model, jit_compile=False, optimizer_class=Adam, xla_loss=True)
    time_the_parts(model, step, args)
    time_the_pipeline(step, args)
    if args.trace:
        features, labels = batch()
        tf.profiler.experimental.start(args.trace)
        for _ in range(5):
            step(features, labels).numpy()
        tf.profiler.experimental.stop()
        print(f"profiler trace: {args.trace}")


if __name__ == "__main__":
    main()
