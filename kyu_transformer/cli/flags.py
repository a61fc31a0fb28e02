"""Defines the flags the programs share, each once. It is free of TensorFlow, so that a program
refuses a wrong flag before TensorFlow loads."""

import re

from kyu_transformer import filenames
from kyu_transformer.conventions import check_checkpoint_choice
from kyu_transformer.decoding.settings import SearchSettings
from kyu_transformer.precision import AUTO, PRECISION_POLICIES


def add_checkpoint_arguments(parser, prefix=""):
    """Adds the flags that choose the weights of a logdir: ``--logdir`` (required), ``--ckpt``,
    ``--average_last``. With a `prefix` (train.py's ``init_``): ``--init_from`` (optional),
    ``--init_ckpt``, ..."""
    if prefix:
        parser.add_argument(f"--{prefix}from", default=None, metavar="LOGDIR",
                            help="a trained run's logdir: start from its architecture, subword "
                                 "model and weights, with a fresh optimizer and schedule")
    else:
        parser.add_argument("--logdir", required=True, help="a logdir written by train.py")
    parser.add_argument(f"--{prefix}ckpt", default=None, help=f"checkpoint path, or "
                        f"'{filenames.BEST}' (best validation BLEU); default: the latest")
    parser.add_argument(f"--{prefix}average_last", type=int, default=0, metavar="N",
                        help="average the weights of the last N checkpoints (all N must exist; not "
                             f"with --{prefix}ckpt)")


def check_checkpoint_arguments(parser, args, prefix=""):
    """Stops with the parser's error for checkpoint flags that `load_model` would refuse (and,
    with a `prefix`, for ``--<prefix>ckpt`` or ``--<prefix>average_last`` without its logdir)."""
    ckpt, average_last = getattr(args, f"{prefix}ckpt"), getattr(args, f"{prefix}average_last")
    try:
        check_checkpoint_choice(ckpt, average_last)
    except ValueError as error:
        parser.error(re.sub(r"`(\w+)`", rf"--{prefix}\1", str(error)))
    if prefix and not getattr(args, f"{prefix}from") and (ckpt or average_last):
        given = f"--{prefix}ckpt" if ckpt else f"--{prefix}average_last"
        parser.error(f"{given} chooses a checkpoint of --{prefix}from LOGDIR, which is not given")


def add_precision_argument(parser, default_help):
    """Adds ``--mixed_precision``, the precision a program decodes in (`default_help` says its
    default; the weights stay float32)."""
    parser.add_argument("--mixed_precision", default=None, choices=(*PRECISION_POLICIES, AUTO),
                        help=f"precision of decoding ({default_help})")


def refuse_clashes(parser, args, rules):
    """Stops with the parser's error at the first of `rules` that `args` break. A rule is
    ``(broken, message)``: `broken(args)` tells whether the flags clash, `message` says why (a
    string, or a function of `args`). Each program lists its rules in one table."""
    for broken, message in rules:
        if broken(args):
            parser.error(message(args) if callable(message) else message)


def excluding(first, seconds, why, given):
    """Returns the rules that `first` cannot be given with any of `seconds` (`given(args, flag)`
    says whether a flag is given), each saying ``--first and --second exclude each other: why``."""
    return tuple((lambda args, second=second: given(args, first) and given(args, second),
                  f"--{first} and --{second} exclude each other: {why}") for second in seconds)


# Each search flag's value letter and help (the default is added from the field).
_FLAGS = {
    "beam_size": ("K", "1 for greedy search (1 with sampling)"),
    "alpha": ("A", "length-penalty exponent of beam search and of every score"),
    "n_best": ("K", "hypotheses per sentence, best first (at most --beam_size; with sampling, "
                    "that many samples)"),
    "length_margin": ("M", "a translation has at most its source's length + M subwords (EOS "
                           "included, at most maxlen2)"),
    "batch_size": ("N", "most sentences decoded together"),
    "sampling_topk": ("K", "sample each token from the K most likely (0: from all); 1 does not "
                           "sample"),
    "sampling_topp": ("P", "then from the fewest of them whose probability reaches P (1: no cut)"),
    "sampling_temperature": ("T", "logits are divided by T before sampling"),
    "seed": ("S", "of sampling: sentence i draws its sample j from a random stream of (S, i, j)"),
}
SEARCH_FLAGS = tuple(_FLAGS)
SAMPLING_FLAGS = ("sampling_topk", "sampling_topp", "sampling_temperature", "seed")
DEFAULTS = SearchSettings()


def add_search_arguments(parser, names=SEARCH_FLAGS, helps=None):
    """Adds the flags of these `SearchSettings` fields, default None (= the field's default)."""
    for name in names:
        letter, text = _FLAGS[name]
        text = (helps or {}).get(name, text)
        parser.add_argument(f"--{name}", type=SearchSettings.__annotations__[name], default=None,
                            metavar=letter, help=f"{text} (default {getattr(DEFAULTS, name)})")


def given_search_flags(args, names=SEARCH_FLAGS):
    """Returns the search flags given on the command line, as `SearchSettings` fields."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def search_settings(parser, base=None, **fields):
    """Returns `base` (default `SearchSettings()`) with `fields` replaced, or stops with the
    parser's error naming the flags (also for a ``--seed`` without sampling, which
    `SearchSettings` cannot tell from its default)."""
    try:
        settings = (base or SearchSettings()).replace(**fields)
    except ValueError as error:
        parser.error(re.sub(r"`(\w+)`", r"--\1", str(error)))
    if "seed" in fields and not settings.sampling:
        parser.error("--seed applies to sampling: give --sampling_topk K (0 for all tokens, 1 "
                     "does not sample)")
    return settings
