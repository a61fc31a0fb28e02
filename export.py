"""Exports a trained model for use outside this checkout: a SavedModel, a CTranslate2 model, or
one .keras file (Keras loads it after `import kyu_transformer`).

    python export.py --logdir log/small --out export/small
    python export.py --logdir log/small --out export/small --beam_size 4 --n_best 4 --overwrite
    python export.py --logdir log/small --out export/ct2 --format ctranslate2 --quantization int8
    python export.py --logdir log/small --out export/small.keras --format keras --beam_size 4

The model comes from the logdir as for eval.py, decoding in float32 unless --mixed_precision says
otherwise; docs/export.md describes both formats. The flags, --out and the logdir's files are
checked before the model and TensorFlow load.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hparams as hp  # noqa: E402
from kyu_transformer import config, filenames  # noqa: E402
from kyu_transformer.cli.flags import (  # noqa: E402
    SAMPLING_FLAGS, SEARCH_FLAGS, add_checkpoint_arguments, add_precision_argument,
    add_search_arguments, check_checkpoint_arguments, given_search_flags, refuse_clashes,
    search_settings)
from kyu_transformer.cli.startup import start_tensorflow  # noqa: E402
from kyu_transformer.conventions import QUANTIZATIONS  # noqa: E402
from kyu_transformer.data.text import DataError  # noqa: E402
from kyu_transformer.precision import PRECISION_POLICIES  # noqa: E402
from kyu_transformer.safety.writes import (  # noqa: E402
    replace_directory, staging_beside, stops_cleanly_when_full, write_text)
from kyu_transformer.training.logdir import read_trained  # noqa: E402

FORMATS = ("saved_model", "ctranslate2", "keras")
EXAMPLE = "Zwei Hunde spielen im Schnee."


def parse_args(argv):
    """Parses export.py's flags and checks them (`check_args`)."""
    parser = hp.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    parser.add_argument("--format", default="saved_model", choices=FORMATS,
                        help="saved_model (TensorFlow, text in and out), ctranslate2, or keras "
                             "(one file: the model, its subword model and search settings)")
    # --format ctranslate2 refuses these rather than ignoring them (check_args).
    add_search_arguments(parser, [flag for flag in SEARCH_FLAGS if flag != "seed"], helps={
        "batch_size": "most sentences the SavedModel decodes together (a request of any size "
                      "is decoded in batches of this size)",
        "n_best": "hypotheses per sentence, best first, of every signature (at most "
                  "--beam_size; of the sample signature, samples)",
        "sampling_topk": "add the sample signature (text and seed in), which draws each token "
                         "from the K most likely (0: from all)"})
    add_precision_argument(parser, "default no: float32, since the serving machine is not "
                                   "known; auto chooses for this machine")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="weight type of --format ctranslate2 (default float32)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out (once the new export is complete)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Stops with an error naming the flag, for a value out of range or flags that clash; sets
    `args.settings` and `args.sampling`, the `SearchSettings` of the SavedModel's signatures."""
    refuse_clashes(parser, args, CLASHES)
    given = given_search_flags(args)
    searching = {flag: value for flag, value in given.items() if flag not in SAMPLING_FLAGS}
    args.settings = search_settings(parser, **searching)
    # The sample signature: the same settings, sampling (its seed comes with each request).
    sampling = {flag: value for flag, value in given.items() if flag in SAMPLING_FLAGS}
    if sampling.get("sampling_topk") == 1:
        parser.error("--sampling_topk 1 does not sample: give 0 (all tokens) or K > 1 for "
                     "the sample signature")
    args.sampling = (search_settings(parser, **{**searching, "beam_size": 1, **sampling})
                     if sampling else None)
    if args.format == "keras":  # one set of settings: the file's, sampling or not
        args.settings, args.sampling = search_settings(parser, **given), None
    check_checkpoint_arguments(parser, args)


# The flags that cannot be given together, and why (`refuse_clashes`).
CLASHES = (
    (lambda args: args.format == "ctranslate2" and given_search_flags(args),
     lambda args: f"{', '.join('--' + flag for flag in given_search_flags(args))} applies to "
                  "--format saved_model only: a CTranslate2 model holds no search settings, they "
                  "are given when it translates (python eval.py --ctranslate2 DIR "
                  "--beam_size ... --alpha ...)"),
    (lambda args: args.mixed_precision and args.format == "ctranslate2",
     lambda args: f"--mixed_precision ({args.mixed_precision}) applies to --format saved_model "
                  "only: a CTranslate2 model computes in its --quantization weight type"),
    (lambda args: args.mixed_precision and args.format == "keras",
     lambda args: f"--mixed_precision ({args.mixed_precision}) applies to --format saved_model "
                  "only: a .keras file computes in the precision it is loaded under"),
    (lambda args: args.quantization and args.format != "ctranslate2",
     lambda args: f"--quantization ({args.quantization}) applies to --format ctranslate2 "
                  f"only: --format {args.format} keeps the model's float32 weights"),
)


# Files that only an earlier export holds: --overwrite replaces nothing else.
EXPORT_MARKERS = ((filenames.SAVED_MODEL_GRAPH, filenames.SAVED_MODEL_SETTINGS),
                  (filenames.CTRANSLATE2_MODEL, filenames.CTRANSLATE2_SETTINGS))


def check_out(out, overwrite, logdir, export_format="saved_model"):
    """Refuses (SystemExit) an `out` that is a file, is or holds the logdir, or is a non-empty
    directory other than an earlier export, or that without `overwrite`; for --format keras, an
    `out` that does not end with .keras, is a directory, or exists without `overwrite`."""
    if export_format == "keras":
        check_keras_out(out, overwrite)
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"error: --out {out} is a file, not a directory")
    out_path, logdir_path = os.path.realpath(out), os.path.realpath(logdir)
    if os.path.commonpath([out_path, logdir_path]) == out_path:
        raise SystemExit(f"error: --out {out} is or holds the --logdir {logdir}; write the "
                         "export elsewhere (it would replace the logdir)")
    if not (os.path.isdir(out) and os.listdir(out)):
        return
    if not any(all(os.path.isfile(os.path.join(out, name)) for name in marker)
               for marker in EXPORT_MARKERS):
        raise SystemExit(f"error: --out {out} is a non-empty directory that holds no earlier "
                         "export; --overwrite replaces only an export ("
                         + ", or ".join(" and ".join(marker) for marker in EXPORT_MARKERS) + ")")
    if not overwrite:
        raise SystemExit(f"error: --out {out} already exists and is not empty; pass --overwrite "
                         "to replace it (the old one stays until the new export is complete)")


def check_keras_out(out, overwrite):
    """Refuses (SystemExit) a --format keras `out` that cannot be written or replaced."""
    if not out.endswith(".keras"):
        raise SystemExit(f"error: --out {out}: --format keras writes one file named *.keras")
    if os.path.isdir(out):
        raise SystemExit(f"error: --out {out} is a directory, not a .keras file")
    if os.path.exists(out) and not overwrite:
        raise SystemExit(f"error: --out {out} already exists; pass --overwrite to replace it "
                         "(the old one stays until the new file is complete)")


def write_keras_file(args, hparams, model, subwords, target):
    """Writes the `TranslationModel` of `model` (its weights), `subwords` and --out's search
    settings to the `.keras` file `target`."""
    from kyu_transformer.decoding.translation_model import TranslationModel

    translator = TranslationModel(hparams, args.settings, subwords)
    translator.transformer.set_weights(model.get_weights())
    translator.save(target)


def load(args):
    """Reads ``(hparams, subwords, model, checkpoints, precision)`` from --logdir as eval.py
    does; the Keras dtype policy is set to `precision` (--mixed_precision, by default float32)."""
    try:
        hparams, subwords = read_trained(args.logdir)
    except (config.HParamsError, DataError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"devices: {start_tensorflow()}")
    from kyu_transformer.training.checkpoints import CheckpointError, load_trained

    try:
        model, checkpoints, precision = load_trained(
            hparams, args.logdir, args.ckpt, args.average_last, args.mixed_precision or "no")
    except CheckpointError as error:
        raise SystemExit(f"error: {error}") from None
    return hparams, subwords, model, checkpoints, precision


def write_saved_model(args, model, subwords, checkpoints, precision, target):
    """Writes the SavedModel to `target` (not existing yet) with a record of its settings;
    returns the names of its signatures (without tensorflow-text, the ids one only)."""
    from kyu_transformer.export import saved_model
    from kyu_transformer.training.checkpoints import describe

    signatures = saved_model.save(model, subwords.path, args.settings, target,
                                  sampling=args.sampling)
    record = {"format": "saved_model", "signatures": signatures, "logdir": args.logdir,
              "checkpoint": describe(checkpoints), "checkpoints": checkpoints,
              "mixed_precision": precision, "compute_dtype": PRECISION_POLICIES[precision],
              **{name: getattr(args.settings, name)
                 for name in ("beam_size", "alpha", "n_best", "length_margin", "batch_size")},
              "sample": None if saved_model.SAMPLE_SIGNATURE not in signatures else {
                  name: getattr(args.sampling, name)
                  for name in ("sampling_topk", "sampling_topp", "sampling_temperature", "n_best")},
              "maxlen1": model.maxlen1, "maxlen2": model.maxlen2,
              "subword_model": os.path.join("assets", os.path.basename(subwords.path))}
    path = os.path.join(target, filenames.SAVED_MODEL_SETTINGS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text(path, json.dumps(record, indent=2) + "\n")
    return signatures


def print_saved_model_usage(out, signatures, args, checkpoint, precision):
    """Says what was written (`checkpoint`: its description) and how to call, load and serve it."""
    from kyu_transformer.export import saved_model

    settings, sampling = args.settings, args.sampling
    search = (f"beam {settings.beam_size}, alpha {settings.alpha}" if settings.beam_size > 1
              else f"greedy, alpha {settings.alpha} for the scores")
    print(f"wrote a SavedModel to {out}: checkpoint {checkpoint}; {search}, "
          f"n_best {settings.n_best}, length margin {settings.length_margin}; decoding in "
          f"{PRECISION_POLICIES[precision]}")
    if saved_model.SAMPLE_SIGNATURE in signatures:
        print(f"{saved_model.SAMPLE_SIGNATURE}: {sampling.n_best} samples per sentence, top-k "
              f"{sampling.sampling_topk}, top-p {sampling.sampling_topp}, temperature "
              f"{sampling.sampling_temperature}; call it with text=..., seed=tf.constant(S, "
              "tf.int64)")
    print(f"signatures: {', '.join(signatures)}  (saved_model_cli show --dir {out} --all)")
    if saved_model.TEXT_SIGNATURE not in signatures:
        print("note: tensorflow-text is not installed, so only the ids signature was written "
              f"(subword ids in and out); for the text signature: {saved_model.SERVE_EXTRA}, "
              "then export again")
        return
    name = os.path.basename(os.path.abspath(out))
    print("call it from Python (TensorFlow and tensorflow-text, without this package):")
    print("  import tensorflow as tf, tensorflow_text  # tensorflow_text registers the "
          "SentencePiece ops")
    print(f"  translate = tf.saved_model.load({out!r}).signatures[{saved_model.TEXT_SIGNATURE!r}]")
    print(f"  print(translate(text=tf.constant([{EXAMPLE!r}]))[\"translations\"])")
    print("serve it with TensorFlow Serving (REST on port 8501):")
    print(f'  docker run -p 8501:8501 -v "$(realpath {out}):/models/{name}/1" '
          f"-e MODEL_NAME={name} tensorflow/serving")
    print(f"  curl -d '{{\"instances\": [\"{EXAMPLE}\"]}}' "
          f"http://localhost:8501/v1/models/{name}:predict")


def print_ctranslate2_usage(out, args, checkpoint):
    """Says what was written (`checkpoint`: its description) and how to translate with it."""
    print(f"wrote a CTranslate2 model to {out}: checkpoint {checkpoint}, weights "
          f"{args.quantization or 'float32'}")
    print("translate and score a split or a file with it (search settings given here):")
    print(f"  python eval.py --logdir {args.logdir} --ctranslate2 {out} --beam_size "
          f"{args.settings.beam_size} --alpha {args.settings.alpha}")
    print("or from Python, as eval.py decodes (EOS appended, the same length limits):")
    print("  from kyu_transformer.export.ctranslate2 import CTranslate2Translator")
    print(f"  CTranslate2Translator({out!r}, beam_size={args.settings.beam_size})"
          ".translate_ids(source_ids).outputs")
    print("  (source_ids: lists of subword ids without EOS, from the subword model in the "
          "directory)")


def print_keras_usage(out, args, checkpoint):
    """Says what was written (`checkpoint`: its description) and how to load and use it."""
    settings = args.settings
    print(f"wrote {out}: checkpoint {checkpoint}, its subword model and search settings (beam "
          f"{settings.beam_size}, alpha {settings.alpha}), weights float32")
    print("load it in Python (Keras with kyu_transformer installed; no logdir needed):")
    print("  import keras, kyu_transformer")
    print(f"  translator = keras.saving.load_model({out!r})")
    print(f"  print(translator.translate([{EXAMPLE!r}]))")
    print(f"or evaluate it: python eval.py --logdir {out} --split test_2016_flickr")


@stops_cleanly_when_full
def main(argv=None):
    """Runs export.py: checks the flags and --out, loads the model, writes the export beside --out
    and puts it in place whole, then says how to use it; returns the exit status."""
    args = parse_args(argv)
    check_out(args.out, args.overwrite, args.logdir, args.format)
    hparams, subwords, model, checkpoints, precision = load(args)
    from kyu_transformer.export import ctranslate2
    from kyu_transformer.training.checkpoints import describe

    try:  # a new hidden directory beside --out, to write the export in first
        staging = staging_beside(args.out, "export")
    except OSError as error:
        raise SystemExit(f"error: cannot write beside --out {args.out} ({error})") from None
    target = os.path.join(staging, "new")
    try:
        if args.format == "keras":
            write_keras_file(args, hparams, model, subwords, target + ".keras")
            os.replace(target + ".keras", args.out)
        elif args.format == "ctranslate2":
            try:
                ctranslate2.convert(model, hparams, subwords, target,
                                    quantization=args.quantization or "float32")
            except (ctranslate2.ExportError, ImportError) as error:  # or no ctranslate2
                raise SystemExit(f"error: --format ctranslate2: {error}") from None
        else:
            signatures = write_saved_model(args, model, subwords, checkpoints, precision, target)
        if args.format != "keras":
            replace_directory(target, args.out, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if args.format == "keras":
        print_keras_usage(args.out, args, describe(checkpoints))
    elif args.format == "ctranslate2":
        print_ctranslate2_usage(args.out, args, describe(checkpoints))
    else:
        print_saved_model_usage(args.out, signatures, args, describe(checkpoints), precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
