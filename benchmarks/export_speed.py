"""Decoding a test set through each way a trained model leaves the project, in one run.

    python benchmarks/export_speed.py --logdir log/small [--beam_size 4] [--repeats 3] [--runs 3]

Exports the logdir's latest checkpoint with export.py (a SavedModel, and
CTranslate2 models in float32 and int8), then translates test_2016_flickr with
beam search through: our `Translator` (the first call includes tracing the
search), the SavedModel's text signature (the first call includes loading it),
and CTranslate2 float32 and int8 (`--threads` intra-op threads; the first call
includes loading the model). Each is then run `--repeats` more times; the
median of those is its steady state. A first call happens once per process:
each path is measured in a fresh Python process, `--runs` times, the paths
taking turns (so that the machine's drifts in speed reach all alike). Prints
each run, then the medians over runs of the first call, the steady state and
their difference, sentences/s, BLEU and the steady-state ratio of each to
CTranslate2 float32. Needs the `serve` extra
(`pip install -e ".[serve]"`: tensorflow-text and ctranslate2).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from prerequisites import DEFAULT_DATA, ROOT, require, require_data  # noqa: E402


def export(logdir, out, *flags):
    """Runs export.py as a user would; returns the seconds it took."""
    started = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "--logdir", logdir,
                    "--out", out, *flags], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def timed(function, repeats):
    """``(seconds of the first call, median seconds of `repeats` more, last output)``."""
    started = time.perf_counter()
    output = function()
    first = time.perf_counter() - started
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        output = function()
        seconds.append(time.perf_counter() - started)
    return first, statistics.median(seconds), output


def ours(logdir, hparams, subwords, sources, args):
    from kyu_transformer.decoding.translator import Translator
    from kyu_transformer.precision import set_precision
    from kyu_transformer.training.checkpoints import load_model

    set_precision(hparams["mixed_precision"])
    model, _ = load_model(hparams, logdir)
    translator = Translator(model, beam_size=args.beam_size, alpha=args.alpha,
                            batch_size=args.batch_size)
    return timed(lambda: translator.translate(sources, subwords), args.repeats)


def saved_model(directory, sources, args):
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (registers the SentencePiece ops)

    state = {}

    def translate():
        if "signature" not in state:  # the first call loads the SavedModel
            state["signature"] = tf.saved_model.load(directory).signatures["serving_default"]
        outputs = state["signature"](text=tf.constant(sources))["translations"]
        return [line.decode("utf-8") for line in outputs.numpy()]

    return timed(translate, args.repeats)


def ctranslate2_model(directory, hparams, subwords, sources, args):
    from kyu_transformer.export.ctranslate2 import CTranslate2Translator

    state = {}

    def translate():
        if "engine" not in state:  # the first call loads the model
            state["engine"] = CTranslate2Translator(
                directory, beam_size=args.beam_size, alpha=args.alpha,
                batch_size=args.batch_size, translator_options={"intra_threads": args.threads})
        return state["engine"].translate(sources, subwords)

    return timed(translate, args.repeats)


def main():
    args = parse_args()
    if args.measure:
        measure(args)
        return
    require("tensorflow_text", "serve", hint="")
    require("ctranslate2", "serve", hint="")
    require_data(args.data_dir)

    from kyu_transformer import config, filenames

    hparams = config.load(os.path.join(args.logdir, filenames.HPARAMS))
    sources = load_split(args)[0]
    exports = tempfile.mkdtemp(prefix="export-speed-")
    try:
        run_all(args, hparams, len(sources), exports)
    finally:
        shutil.rmtree(exports, ignore_errors=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default=os.path.join(ROOT, "log", "small"))
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--beam_size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--batch_size", type=int, default=128, help="eval.py's default")
    parser.add_argument("--threads", type=int, default=2, help="CTranslate2's intra-op threads")
    parser.add_argument("--repeats", type=int, default=3,
                        help="calls after the first in each process (steady = their median)")
    parser.add_argument("--runs", type=int, default=3,
                        help="fresh processes per path (figures = medians over runs)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # PATH:DIR, one run
    return parser.parse_args()


def load_split(args):
    from kyu_transformer.data.text import load_split

    return load_split(args.data_dir, args.split)[:2]


PATHS = ("ours (Translator)", "SavedModel", "CTranslate2 float32", "CTranslate2 int8")


def measure(args):
    """One run of one path in this fresh process; prints its figures as a JSON line."""
    import sacrebleu

    from kyu_transformer import config, filenames
    from kyu_transformer.data.subwords import Subwords
    from kyu_transformer.data.text import load_split

    name, exports = args.measure.split(":", 1)
    hparams = config.load(os.path.join(args.logdir, filenames.HPARAMS))
    subwords = Subwords(os.path.join(args.logdir, filenames.SUBWORDS))
    sources, references = load_split(args)
    if name == "ours (Translator)":
        first, steady, hypotheses = ours(args.logdir, hparams, subwords, sources, args)
    elif name == "SavedModel":
        first, steady, hypotheses = saved_model(os.path.join(exports, "saved_model"), sources,
                                                args)
    else:
        directory = os.path.join(exports, "ct2-" + name.split()[-1])
        first, steady, hypotheses = ctranslate2_model(directory, hparams, subwords, sources,
                                                      args)
    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
    print(json.dumps({"first": first, "steady": steady, "bleu": bleu}))


def run_once(args, name, exports):
    """``{first, steady, bleu}`` of `name` measured in a fresh process."""
    command = [sys.executable, os.path.abspath(__file__), "--measure", f"{name}:{exports}"]
    for flag in ("logdir", "data_dir", "split", "beam_size", "alpha", "batch_size", "threads",
                 "repeats"):
        command += [f"--{flag}", str(getattr(args, flag))]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def run_all(args, hparams, count, exports):
    beam = ["--beam_size", str(args.beam_size), "--alpha", str(args.alpha),
            "--batch_size", str(args.batch_size)]
    # The SavedModel in the logdir's precision, as `ours` decodes (export.py's default is float32).
    precision = ["--mixed_precision", hparams["mixed_precision"]]
    for name, flags in (("saved_model", beam + precision),
                        ("ct2-float32", ["--format", "ctranslate2"]),
                        ("ct2-int8", ["--format", "ctranslate2", "--quantization", "int8"])):
        seconds = export(args.logdir, os.path.join(exports, name), *flags)
        print(f"exported {name} in {seconds:.1f} s", flush=True)

    runs = {name: [] for name in PATHS}
    for run in range(args.runs):
        for name in PATHS:
            result = run_once(args, name, exports)
            runs[name].append(result)
            print(f"run {run + 1} {name}: first call {result['first']:.2f} s, steady "
                  f"{result['steady']:.2f} s, BLEU {result['bleu']:.2f}", flush=True)
    print_table(args, hparams, count, runs)


def print_table(args, hparams, count, runs):
    """The medians over runs of each path's figures, as a markdown table."""
    def median(name, key):
        return statistics.median(result[key] for result in runs[name])

    reference = median("CTranslate2 float32", "steady")
    print(f"\n{count} sentences of {args.split}, beam {args.beam_size}, alpha {args.alpha}, "
          f"batches of {args.batch_size}; medians over {args.runs} fresh processes per path "
          f"(steady: median of {args.repeats} calls after the first in each); ours and the "
          f"SavedModel compute in {hparams['mixed_precision']} precision (the logdir's, given "
          "to both), CTranslate2 in its weight type")
    print("| path | first call (s) | steady (s) | first - steady (s) | sentences/s | BLEU | "
          "steady vs CTranslate2 float32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in PATHS:
        over = statistics.median(result["first"] - result["steady"] for result in runs[name])
        steady = median(name, "steady")
        print(f"| {name} | {median(name, 'first'):.2f} | {steady:.2f} | {over:.2f} | "
              f"{count / steady:.0f} | {median(name, 'bleu'):.2f} | "
              f"{steady / reference:.2f}x |")


if __name__ == "__main__":
    main()
