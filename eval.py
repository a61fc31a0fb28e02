"""Translates with a trained model and scores the result with sacreBLEU.

    python eval.py --logdir log/small --split test_2016_flickr --beam_size 4
    python eval.py --logdir log/small --src my.de --ref my.en --n_best 4
    echo "Ein Hund rennt." | python eval.py --logdir log/small --src -
    python eval.py --logdir log/small --src my.de --score my.en
    python eval.py --logdir log/small --ctranslate2 exported/ct2 --beam_size 4
    python eval.py --logdir exported/small.keras --src my.de --target_prefix my.prefixes

The model, its hparams and subword model come from the logdir (or a .keras file of export.py,
with its search settings), the outputs go to <logdir>/eval/<name>.* (<file>-eval/ for a .keras
file; docs/evaluation.md); flags, files and inputs are checked first.
"""

import json
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hparams as hp  # noqa: E402
from kyu_transformer import config, filenames  # noqa: E402
from kyu_transformer.cli.flags import (  # noqa: E402
    SAMPLING_FLAGS, add_checkpoint_arguments, add_precision_argument, add_search_arguments,
    check_checkpoint_arguments, excluding, given_search_flags, refuse_clashes, search_settings)
from kyu_transformer.cli.startup import start_tensorflow  # noqa: E402
from kyu_transformer.decoding.archive import is_archive, read_archive  # noqa: E402
from kyu_transformer.decoding.settings import SearchSettings  # noqa: E402
from kyu_transformer.data.text import (  # noqa: E402
    DataError, check_data_dir, normalize_line, read_lines, split_files)
from kyu_transformer.precision import AUTO  # noqa: E402
from kyu_transformer.safety.writes import stops_cleanly_when_full, write_text  # noqa: E402
from kyu_transformer.training.logdir import read_trained  # noqa: E402


def parse_args(argv):
    """Parses eval.py's flags and checks them (`check_args`)."""
    parser = hp.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_arguments(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--split", default=None,
                        help="split of the data folder to translate (default test_2016_flickr)")
    source.add_argument("--src", default=None, help="source text file, or - for standard input")
    parser.add_argument("--ref", default=None, help="reference translations of --src")
    parser.add_argument("--data_dir", default=None, help="default: the logdir's data_dir")
    add_search_arguments(parser, helps={
        "n_best": "also write the K best hypotheses of each sentence (with sampling, K "
                  "samples) and their scores to <name>.nbest.jsonl (K at most --beam_size)"})
    add_precision_argument(parser, "default auto: chosen for this machine; the weights stay "
                                   "float32")
    parser.add_argument("--plot_attention", type=int, default=0, metavar="K",
                        help="save cross-attention heatmaps of the first K sentences, "
                             "decoded greedily whatever --beam_size")
    parser.add_argument("--score", default=None, metavar="FILE",
                        help="instead of translating, score FILE's translations (one per source "
                             "line): log-probability with EOS, and that over GNMT's length "
                             "penalty (--alpha), to <name>.scores.jsonl")
    parser.add_argument("--ctranslate2", default=None, metavar="DIR",
                        help="translate with this CTranslate2 model directory (export.py "
                             "--format ctranslate2), the subword model still from --logdir")
    parser.add_argument("--target_prefix", default=None, metavar="FILE",
                        help="each translation starts with its line of FILE (one per source "
                             "line; an empty line: no prefix); with --src -, give - and end each "
                             "input line with a tab and its prefix")
    parser.add_argument("--name", default=None, help="name of the output files")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Stops with an error naming the flag, for a value out of range or flags that clash; the
    search flags given replace a `.keras` --logdir's own settings."""
    saved = None
    if is_archive(args.logdir):
        try:
            saved = SearchSettings(**read_archive(args.logdir)[1])
        except DataError as error:
            raise SystemExit(f"error: --logdir {error}") from None
        except (TypeError, ValueError) as error:  # settings no SearchSettings takes
            raise SystemExit(f"error: --logdir {args.logdir}: its search settings are not "
                             f"valid ({error})") from None
    args.settings = search_settings(parser, saved, **given_search_flags(args))
    check_checkpoint_arguments(parser, args)
    refuse_clashes(parser, args, CLASHES)


def _given(args, flag):
    if flag == "sampling_topk":
        return args.settings.sampling
    return getattr(args, flag) not in (None, 0, False, "")


# The flags that cannot be given together, and why (`refuse_clashes`).
CLASHES = (
    (lambda args: args.ref and not args.src, "--ref goes with --src"),
    *excluding("score", ("ref",), "--score rates FILE by the model, not by references", _given),
    *excluding("score", ("n_best", "plot_attention", "sampling_topk", "target_prefix"),
               "--score translates nothing", _given),
    *excluding("score", ("ctranslate2",), "--score scores with the logdir's Keras model", _given),
    *excluding("ctranslate2", ("ckpt", "average_last"),
               "the CTranslate2 model holds the weights it was converted from", _given),
    *excluding("ctranslate2", ("mixed_precision",),
               "the CTranslate2 model computes in the weight type it was converted to", _given),
    *excluding("ctranslate2", ("plot_attention",),
               "attention heatmaps come from the Keras model", _given),
    (lambda args: is_archive(args.logdir) and (args.ckpt or args.average_last),
     "--ckpt and --average_last choose a logdir's checkpoints; a .keras file holds its weights"),
    (lambda args: (args.target_prefix == "-") != (args.src == "-") and args.target_prefix,
     "--target_prefix - reads each prefix after a tab in the lines of --src -"),
    (lambda args: args.src == "-" and (args.score or args.n_best),
     lambda args: f"--src - translates standard input line by line; --"
                  f"{'score' if args.score else 'n_best'} needs a file (--src FILE) or --split"),
)


def load_inputs(args, hparams):
    """Reads the sentences to translate; returns ``(name, sources, references or None, targets
    of --score or None, prefixes of --target_prefix or None)``."""
    split = args.split or "test_2016_flickr"
    if args.src:
        (source_path, target_path), reader = (args.src, args.ref), read_lines
    else:
        data_dir = args.data_dir or hparams["data_dir"]
        check_data_dir(data_dir)
        (source_path, target_path), reader = split_files(
            data_dir, split, hparams["src_lang"], hparams["tgt_lang"])
    sources = list(reader(source_path))
    references = list(reader(target_path)) if target_path else None
    if references is not None and len(references) != len(sources):
        raise DataError(f"{source_path} has {len(sources)} lines but {target_path} has "
                        f"{len(references)}")
    if args.src and not sources:
        raise DataError(f"{args.src}: no sentence to translate (the file is empty)")
    targets = read_lines(args.score) if args.score else None
    if targets is not None and len(targets) != len(sources):
        raise DataError(f"{args.score} has {len(targets)} lines but {source_path} has "
                        f"{len(sources)}: --score needs one translation per source line")
    prefixes = read_lines(args.target_prefix) if args.target_prefix else None
    if prefixes is not None and len(prefixes) != len(sources):
        raise DataError(f"{args.target_prefix} has {len(prefixes)} lines but {source_path} has "
                        f"{len(sources)}: --target_prefix needs one line per source line (empty "
                        "for no prefix)")
    name = args.name or (os.path.basename(args.src).split(".")[0] if args.src else split)
    return name, sources, references, targets, prefixes


def write_lines(path, lines):
    """Writes `lines` to `path`, one a line, atomically."""
    write_text(path, "".join(line + "\n" for line in lines))


def plot_attention(model, settings, subwords, sources, count, out_dir, name):
    """Saves heatmaps of the last decoder block's cross-attention (mean of heads); prints paths."""
    from kyu_transformer.decoding.translator import Translator
    from kyu_transformer.training.plots import save_attention

    # Coverage is recorded by greedy search.
    translator = Translator(model, beam_size=1, length_margin=settings.length_margin,
                            batch_size=settings.batch_size)
    source_ids = subwords.encode(sources[:count])
    found = translator.translate_ids(source_ids, with_coverage=True)
    for index, (ids, output, coverage) in enumerate(zip(source_ids, found.outputs,
                                                        found.coverages)):
        if coverage is None:
            continue
        path = filenames.evaluation_file(out_dir, name, filenames.ATTENTION_PLOT.format(index + 1))
        pieces = [subwords.processor.id_to_piece(ids) + ["</s>"] for ids in (ids, output)]
        print(f"attention: {save_attention(coverage, *pieces, path)}")


def load_ctranslate2(args, subwords):
    """Loads the model of --ctranslate2 DIR, checked against the logdir's `subwords`; returns
    ``(translator, facts)``."""
    model_dir = args.ctranslate2
    if not os.path.isdir(model_dir):
        raise DataError(f"--ctranslate2 {model_dir}: no such directory")
    copied = os.path.join(model_dir, filenames.SUBWORDS)  # the converter copies it there
    if os.path.isfile(copied):
        with open(copied, "rb") as handle:
            if handle.read() != subwords.serialized():
                raise DataError(f"{model_dir} was converted with another subword model than "
                                f"{args.logdir}'s: convert its model, or give the logdir it "
                                "came from")
    start_tensorflow()  # which the conversion's module imports
    from kyu_transformer.export.ctranslate2 import CTranslate2Translator, ExportError

    try:
        translator = CTranslate2Translator(model_dir, args.settings)
        translator.load()
    except ImportError:
        raise DataError('--ctranslate2 needs the ctranslate2 package: pip install -e '
                        '".[serve]" (or pip install ctranslate2)') from None
    except ExportError as error:  # not a directory the converter wrote
        raise DataError(str(error)) from None
    except RuntimeError as error:  # CTranslate2's own: a missing or broken model.bin
        raise DataError(f"{model_dir}: CTranslate2 cannot load it ({error})") from None
    loaded = translator.load()  # where CTranslate2 decodes, and in which types
    print(f"devices: CTranslate2 on {loaded.device} (compute type {loaded.compute_type})",
          file=sys.stderr)
    return translator, {"engine": "ctranslate2", "model_dir": model_dir,
                        "quantization": translator.quantization, "device": loaded.device,
                        "compute_type": loaded.compute_type}


def load_translator(args, hparams, subwords):
    """Loads the logdir's model, or that of --ctranslate2 DIR; returns ``(translator, facts for
    the json)``."""
    if args.ctranslate2:
        return load_ctranslate2(args, subwords)
    devices = start_tensorflow()
    # On standard error, as the precision's line: with `--src -` standard output holds
    # translations only.
    print(f"devices: {devices}", file=sys.stderr)
    from kyu_transformer.decoding.translator import Translator
    from kyu_transformer.training.checkpoints import CheckpointError, describe, load_trained

    choice = {}

    def log(line):  # on standard error: with `--src -`, standard output holds translations only
        choice.update(precision_choice=line)
        print(line, file=sys.stderr)

    if is_archive(args.logdir):
        from kyu_transformer.decoding.text_translator import load_translation_model

        loaded, precision = load_translation_model(args.logdir, args.mixed_precision or AUTO,
                                                   log)
        model, checkpoints = loaded.transformer, [args.logdir]
    else:
        try:
            model, checkpoints, precision = load_trained(hparams, args.logdir, args.ckpt,
                                                         args.average_last,
                                                         args.mixed_precision or AUTO, log)
        except CheckpointError as error:
            raise DataError(str(error)) from None
    return Translator(model, args.settings), {
        "engine": "keras", "checkpoint": describe(checkpoints), "checkpoints": checkpoints,
        "mixed_precision": precision, "device": devices, **choice}


def evaluation_dir(logdir):
    """Returns where eval.py writes: <logdir>/eval, or <file>-eval beside a `.keras` file."""
    if is_archive(logdir):
        return os.path.splitext(logdir)[0] + "-" + filenames.EVAL
    return os.path.join(logdir, filenames.EVAL)


def write_scores(translator, subwords, sources, targets, out_dir, name):
    """Writes <name>.scores.jsonl (the model's score of each --score line) and sums it up."""
    scored, truncated_sources = translator.score_ids(subwords.encode(sources),
                                                     subwords.encode(targets))
    rows = [{"source": source, "target": target, **result._asdict()}
            for source, target, result in zip(sources, targets, scored)]
    path = filenames.evaluation_file(out_dir, name, filenames.SCORES)
    write_lines(path, (json.dumps(row, ensure_ascii=False) for row in rows))
    tokens = sum(row["tokens"] for row in rows)
    log_prob = sum(row["log_prob"] for row in rows)
    print(f"{len(rows)} translations scored: {tokens} subwords (EOS included), "
          f"log-probability {log_prob:.2f}, perplexity {math.exp(-log_prob / tokens):.2f}; "
          f"score = log_prob / ((5 + tokens) / 6) ** {translator.settings.alpha} (--alpha)")
    if truncated_sources:
        print(f"note: {truncated_sources} sources were longer than maxlen1="
              f"{translator.maxlen1} subwords and were cut to it")
    truncated_outputs = sum(row["truncated"] for row in rows)
    if truncated_outputs:
        print(f"note: {truncated_outputs} translations were longer than "
              f"{translator.max_length} subwords with EOS (maxlen2): only their first "
              f"{translator.max_length} were scored, without EOS (\"truncated\": true)")
    print(f"scores: {path}")


@stops_cleanly_when_full
def main(argv=None):
    """Runs eval.py: checks the flags and inputs, loads the model, translates (or scores) and
    writes the results; returns the exit status."""
    started = time.time()
    args = parse_args(argv)
    try:
        hparams, subwords = read_trained(args.logdir)
        inputs = None if args.src == "-" else load_inputs(args, hparams)
        translator, facts = load_translator(args, hparams, subwords)
    except (config.HParamsError, DataError) as error:
        raise SystemExit(f"error: {error}")
    if inputs is None:  # --src -: line by line, as it comes
        translate_stdin(translator, subwords, args.target_prefix == "-")
        return 0
    name, sources, references, targets, prefixes = inputs
    out_dir = evaluation_dir(args.logdir)
    os.makedirs(out_dir, exist_ok=True)
    if targets is not None:
        write_scores(translator, subwords, sources, targets, out_dir, name)
        return 0
    translations, hypotheses, decode_seconds = write_translations(
        translator, facts, subwords, (sources, prefixes), args, out_dir, name)
    if args.plot_attention:
        plot_attention(translator.model, args.settings, subwords, sources, args.plot_attention,
                       out_dir, name)
    if references is not None:
        write_result(hypotheses, references, translations, facts, args, out_dir, name,
                     seconds=(time.time() - started, decode_seconds))
    return 0


def translate_stdin(translator, subwords, prefixed):
    """Translates standard input line by line, as it comes, to standard output; `prefixed`:
    each line is a source, a tab and the prefix its translation starts with (a prefix cut to its
    sentence's output limit is said on standard error)."""
    for number, line in enumerate(sys.stdin, start=1):
        source, _, prefix = line.partition("\t") if prefixed else (line, "", "")
        source, prefix = normalize_line(source), normalize_line(prefix)
        if prefixed:
            (source_ids, prefix_ids) = subwords.encode([source, prefix])
            limit = int(translator.output_limits(len(source_ids)))
            if len(prefix_ids) > limit:
                print(f"note: line {number}: its prefix is longer than its output limit "
                      f"({limit} subwords) and was cut to it", file=sys.stderr)
        print(translator.translate([source], subwords, [prefix] if prefixed else None)[0],
              flush=True)


def write_result(hypotheses, references, translations, facts, args, out_dir, name, seconds):
    """Scores the translations, writes <name>.json (the scores and the run's settings) and
    prints the scores; `seconds`: the whole run's and the decoding's."""
    from kyu_transformer.decoding.bleu import score

    searched = ("beam_size", "alpha", "length_margin") + (
        SAMPLING_FLAGS if args.settings.sampling else ())
    result = score(hypotheses, references)
    result.update(**facts, **{key: getattr(args.settings, key) for key in searched},
                  n_best=args.n_best, truncated_sources=translations.truncated_sources,
                  truncated_outputs=translations.truncated_outputs,
                  target_prefix=args.target_prefix,
                  truncated_prefixes=translations.truncated_prefixes,
                  num_sentences=len(hypotheses), seconds=round(seconds[0], 2),
                  decode_seconds=round(seconds[1], 2))
    path = filenames.evaluation_file(out_dir, name, filenames.RESULT)
    write_lines(path, [json.dumps(result, indent=2)])
    print(result["score_line"])
    print(f"chrF2 = {result['chrf']:.2f}")
    print(f"scores: {path}")


def write_translations(translator, facts, subwords, inputs, args, out_dir, name):
    """Translates `inputs` ``(sources, prefixes or None)``, writes <name>.hyp.txt (and
    <name>.nbest.jsonl) and says what was cut; returns ``(translations, hypotheses,
    seconds)``."""
    decode_started = time.time()
    sources, prefixes = inputs
    translations = translator.translate_ids(
        subwords.encode(sources), n_best=args.n_best,
        prefix_ids=None if prefixes is None else subwords.encode(prefixes))
    hypotheses = [subwords.decode(ids) for ids in translations.outputs]
    if args.n_best:  # the rows of <name>.nbest.jsonl
        rows = [{"source": source, "hypotheses": [{"text": subwords.decode(ids), "score": score}
                                                  for ids, score in zip(ids_list, scores)]}
                for source, ids_list, scores in zip(sources, translations.hypotheses,
                                                    translations.scores)]
    decode_seconds = time.time() - decode_started
    hypothesis_path = filenames.evaluation_file(out_dir, name, filenames.HYPOTHESES)
    write_lines(hypothesis_path, hypotheses)
    settings = args.settings
    search = (f"sampling top-k {settings.sampling_topk}, top-p {settings.sampling_topp}, "
              f"temperature {settings.sampling_temperature}, seed {settings.seed}"
              if settings.sampling else f"beam {settings.beam_size}")
    engine = (f"checkpoint {facts['checkpoint']}" if facts["engine"] == "keras"
              else f"CTranslate2 model {facts['model_dir']}")
    print(f"{len(sources)} sentences translated in {decode_seconds:.1f} s "
          f"({len(sources) / max(decode_seconds, 1e-9):.0f} sentences/s), {search}, {engine}")
    print(f"translations: {hypothesis_path}")
    if args.n_best:
        n_best_path = filenames.evaluation_file(out_dir, name, filenames.N_BEST)
        write_lines(n_best_path, (json.dumps(row, ensure_ascii=False) for row in rows))
        print(f"the {args.n_best} best hypotheses and their scores: {n_best_path}")
    if translations.truncated_sources:
        print(f"note: {translations.truncated_sources} sentences were longer than maxlen1="
              f"{translator.maxlen1} subwords and were cut to it")
    if translations.truncated_prefixes:
        print(f"note: {translations.truncated_prefixes} prefixes were longer than their "
              f"sentence's output limit (source length + {translator.settings.length_margin} "
              f"subwords, at most {translator.max_length}) and were cut to it")
    if translations.truncated_outputs:
        print(f"note: {translations.truncated_outputs} translations reached their length limit "
              f"(source length + {translator.settings.length_margin} subwords, at most "
              f"{translator.max_length}) before ending and were cut there")
    return translations, hypotheses, decode_seconds


if __name__ == "__main__":
    sys.exit(main())
