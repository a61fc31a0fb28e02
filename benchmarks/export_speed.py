"""Decoding a test set through each way a trained model leaves the project, in one run.

    python benchmarks/export_speed.py --logdir log/small [--beam_size 4] [--repeats 3]

Exports the logdir's latest checkpoint with export.py (a SavedModel, and
CTranslate2 models in float32 and int8), then translates test_2016_flickr with
beam search through: our `Translator` (the first call includes tracing the
search), the SavedModel's text signature (the first call includes loading it),
and CTranslate2 float32 and int8 (`--threads` intra-op threads; the first call
includes loading the model). Each is then run `--repeats` more times; the
median of those is its steady state. Prints seconds, sentences/s, BLEU and the
steady-state ratio of each to CTranslate2 float32. Needs the `serve` extra
(`pip install -e ".[serve]"`: tensorflow-text and ctranslate2).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from prerequisites import DEFAULT_DATA, require, require_data  # noqa: E402


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
    from kyu_transformer.checkpoints import load_model
    from kyu_transformer.decoding import Translator
    from kyu_transformer.training import set_precision

    set_precision(hparams["mixed_precision"])
    model, _ = load_model(hparams, logdir)
    translator = Translator(model, beam_size=args.beam_size, alpha=args.alpha)
    return timed(lambda: translator.translate(sources, subwords, args.batch_size), args.repeats)


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
    import ctranslate2

    from kyu_transformer.ctranslate2_export import translate_with_ctranslate2

    source_ids = subwords.encode(sources)
    state = {}

    def translate():
        if "translator" not in state:  # the first call loads the model
            state["translator"] = ctranslate2.Translator(directory, device="cpu",
                                                         intra_threads=args.threads)
        results = translate_with_ctranslate2(
            directory, source_ids, beam_size=args.beam_size, alpha=args.alpha,
            maxlen1=hparams["maxlen1"], maxlen2=hparams["maxlen2"],
            translator=state["translator"], batch_size=args.batch_size)
        return [subwords.decode(hypotheses[0].ids) for hypotheses in results]

    return timed(translate, args.repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default=os.path.join(ROOT, "log", "small"))
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--beam_size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--batch_size", type=int, default=128, help="eval.py's default")
    parser.add_argument("--threads", type=int, default=2, help="CTranslate2's intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    require("tensorflow_text", "serve", hint="")
    require("ctranslate2", "serve", hint="")
    require_data(args.data_dir)

    import hparams as hp
    from kyu_transformer import data

    hparams = hp.load(os.path.join(args.logdir, "hparams.json"))
    subwords = data.Subwords(os.path.join(args.logdir, data.Subwords.FILE_NAME))
    sources, references, _ = data.load_split(args.data_dir, args.split)
    exports = tempfile.mkdtemp(prefix="export-speed-")
    try:
        run_all(args, hparams, subwords, sources, references, exports)
    finally:
        shutil.rmtree(exports, ignore_errors=True)


def run_all(args, hparams, subwords, sources, references, exports):
    import sacrebleu

    beam = ["--beam_size", str(args.beam_size), "--alpha", str(args.alpha),
            "--batch_size", str(args.batch_size)]
    for name, flags in (("saved_model", beam),
                        ("ct2-float32", ["--format", "ctranslate2"]),
                        ("ct2-int8", ["--format", "ctranslate2", "--quantization", "int8"])):
        seconds = export(args.logdir, os.path.join(exports, name), *flags)
        print(f"exported {name} in {seconds:.1f} s", flush=True)

    runs = {
        "ours (Translator)": lambda: ours(args.logdir, hparams, subwords, sources, args),
        "SavedModel": lambda: saved_model(os.path.join(exports, "saved_model"), sources, args),
        "CTranslate2 float32": lambda: ctranslate2_model(
            os.path.join(exports, "ct2-float32"), hparams, subwords, sources, args),
        "CTranslate2 int8": lambda: ctranslate2_model(
            os.path.join(exports, "ct2-int8"), hparams, subwords, sources, args),
    }
    results = {}
    for name, run in runs.items():
        first, steady, hypotheses = run()
        bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
        results[name] = (first, steady, bleu)
        print(f"{name}: first call {first:.2f} s, steady {steady:.2f} s, BLEU {bleu:.2f}",
              flush=True)

    reference = results["CTranslate2 float32"][1]
    print(f"\n{len(sources)} sentences of {args.split}, beam {args.beam_size}, alpha "
          f"{args.alpha}, batches of {args.batch_size}; steady = median of {args.repeats}; "
          f"ours and the SavedModel compute in {hparams['mixed_precision']} precision "
          "(the logdir's, as eval.py), CTranslate2 in its weight type")
    print("| path | first call (s) | steady (s) | sentences/s | BLEU | steady vs CTranslate2 "
          "float32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (first, steady, bleu) in results.items():
        print(f"| {name} | {first:.2f} | {steady:.2f} | {len(sources) / steady:.0f} | "
              f"{bleu:.2f} | {steady / reference:.2f}x |")


if __name__ == "__main__":
    main()
