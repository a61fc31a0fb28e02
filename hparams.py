"""The hyperparameters as the programs take them: presets, parsing and validation.

Every key (its default, its role and its help) is defined once, in `kyu_transformer.hparam_keys`.

``--hparams`` joins presets, JSON files and ``key=value`` parts by commas, later ones winning
(``--hparams small,lr=2.0``); single flags (``--batch_size 64``) override them all.
"""

import argparse
import contextlib
import difflib
import json
import os

from kyu_transformer.conventions import NORM_POSITIONS, check_decay, check_heads
from kyu_transformer.hparam_keys import DEFAULTS, HELP, SPEC  # noqa: F401  (the programs' names)
from kyu_transformer.precision import AUTO, PRECISION_POLICIES
from kyu_transformer.safety.writes import write_text

CHOICES = {"norm_position": NORM_POSITIONS, "mixed_precision": (*PRECISION_POLICIES, AUTO),
           "subword_model_type": ("unigram", "bpe")}
POSITIVE = ("vocab_size", "maxlen1", "maxlen2", "batch_size", "d_model", "d_ff", "num_blocks",
            "num_heads", "lr", "warmup_steps", "num_epochs", "keep_checkpoints", "log_every",
            "epsilon", "eval_batch_size", "accumulate_steps")
NON_NEGATIVE = ("batch_tokens", "steps_per_epoch", "max_minutes", "checkpoint_every",
                "eval_sentences", "seed", "subword_alpha", "decay_steps")
RATES = ("dropout_rate", "smoothing", "relu_dropout", "word_dropout")

PRESETS = {
    # For tests and smoke runs. No `xla_loss`: in a few dozen updates, compiling the loss
    # for each new batch shape costs more than the fused loss saves.
    "tiny": dict(vocab_size=400, d_model=32, d_ff=64, num_blocks=1, num_heads=2,
                 maxlen1=48, maxlen2=48, batch_size=32, batch_tokens=1024, dropout_rate=0.0,
                 lr=2.0, warmup_steps=40, num_epochs=1, steps_per_epoch=30, log_every=10,
                 checkpoint_every=0, eval_sentences=0, xla_loss=False, logdir="log/tiny"),
    # The CPU recipe for Multi30k. Its 30 epochs are about 4,500 updates: `decay_steps` brings
    # the rate to 0 at their end (chosen on val; benchmarks/RESULTS.md, "Recipe search").
    "small": dict(vocab_size=8000, d_model=256, d_ff=1024, num_blocks=3, num_heads=4,
                  maxlen1=64, maxlen2=64, batch_size=256, batch_tokens=4096, dropout_rate=0.1,
                  lr=0.8, warmup_steps=800, decay_steps=4500, num_epochs=30, mixed_precision="auto",
                  checkpoint_every=100, keep_checkpoints=8, logdir="log/small"),
    # The paper's base model.
    "base": dict(d_model=512, d_ff=2048, num_blocks=6, num_heads=8, dropout_rate=0.1,
                 lr=1.0, warmup_steps=4000, mixed_precision="auto", logdir="log/base"),
}


class HParamsError(ValueError):
    """A hyperparameter problem; the message lists every problem found."""


def _closest(name, names=SPEC):
    match = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean `{match[0]}`?)" if match else ""


def _convert(name, value):
    """`value` (a string from the command line, or a JSON value) as the type of `name`."""
    kind = type(DEFAULTS[name])
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() not in ("true", "1", "yes", "false", "0", "no"):
                raise HParamsError(f"`{name}` must be true or false, got {value!r}")
            return text.lower() in ("true", "1", "yes")
        with contextlib.suppress(ValueError):  # the error below
            return kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise HParamsError(f"`{name}` must be {kind.__name__}, got {value!r}")


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except json.JSONDecodeError as error:
        raise HParamsError(f"{path}, line {error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(values, dict):
        raise HParamsError(f"{path}: expected a JSON object of hyperparameters")
    return values


def _parse_part(part):
    """One comma-separated part of `--hparams`: a preset, a JSON file or key=value."""
    if "=" in part:
        key, value = part.split("=", 1)
        return {key.strip(): value}
    if part in PRESETS:
        return dict(PRESETS[part])
    if part.endswith(".json") or os.path.sep in part:
        if not os.path.isfile(part):
            raise HParamsError(f"--hparams: no such JSON file: {part}")
        return _read_json(part)
    raise HParamsError(f"--hparams: {part!r} is neither a preset ({', '.join(PRESETS)})"
                       f"{_closest(part, PRESETS)}, a JSON file nor key=value")


def _given(spec="", overrides=None):
    """The values a `--hparams` string and overrides give (later ones winning), unconverted."""
    values = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        values.update(_parse_part(part))
    values.update(overrides or {})
    return values


def parse(spec="", overrides=None):
    """Resolves a `--hparams` string and a dict of overrides into validated hparams."""
    return resolve(_given(spec, overrides))


def resolve(values):
    """DEFAULTS updated with `values`, converted and validated; raises HParamsError."""
    problems = []
    hparams = dict(DEFAULTS)
    for name, value in values.items():
        if name not in SPEC:
            problems.append(f"unknown hyperparameter `{name}`{_closest(name)}; "
                            f"valid ones: {', '.join(sorted(SPEC))}")
            continue
        try:
            hparams[name] = _convert(name, value)
        except HParamsError as error:
            problems.append(str(error))
    if not problems:
        problems = check(hparams)
    if problems:
        raise HParamsError("bad hyperparameters:\n  - " + "\n  - ".join(problems))
    return hparams


def check(hparams):
    """The list of problems of a fully typed hparams dict (empty when valid)."""
    ranges = ((POSITIVE, lambda value: value > 0, "positive"),
              (NON_NEGATIVE, lambda value: value >= 0, ">= 0"),
              (RATES, lambda value: 0.0 <= value < 1.0, "in [0, 1)"),
              (("attention_dropout",), lambda value: value == -1.0 or 0.0 <= value < 1.0,
               "in [0, 1) or -1 (as dropout_rate)"))
    problems = [f"`{name}` must be {text}, got {hparams[name]}"
                for names, valid, text in ranges for name in names if not valid(hparams[name])]
    problems += [f"`{name}` must be one of {', '.join(choices)}, got {hparams[name]!r}"
                 for name, choices in CHOICES.items() if hparams[name] not in choices]
    if hparams["num_heads"] > 0:
        problems += _broken(check_heads, hparams["d_model"], hparams["num_heads"])
    if hparams["subword_alpha"] > 0 and hparams["subword_model_type"] != "unigram":
        problems.append("`subword_alpha` samples segmentations of a unigram model; "
                        f"`subword_model_type` is {hparams['subword_model_type']!r}")
    problems += _broken(check_decay, hparams["decay_steps"], hparams["warmup_steps"])
    longest = max(hparams["maxlen1"], hparams["maxlen2"])
    if hparams["batch_tokens"] and hparams["batch_tokens"] < longest:
        problems.append(f"`batch_tokens` ({hparams['batch_tokens']}) must be 0 or at least the "
                        f"longest sequence ({longest})")
    return problems


def _broken(rule, *args):
    """The message of the ValueError `rule(*args)` raises (without its full stop), as a list."""
    try:
        rule(*args)
    except ValueError as error:
        return [str(error).rstrip(".")]
    return []


def _overrides(args):
    return {name: getattr(args, name) for name in SPEC if getattr(args, name) is not None}


def from_args(args):
    """The hparams given by parsed `argument_parser` flags."""
    return parse(args.hparams, _overrides(args))


def given_keys(args):
    """The names the flags set (by a preset, a JSON file, key=value or a flag), not defaulted."""
    return set(_given(args.hparams, _overrides(args)))


def save(hparams, path):
    """Writes `hparams` to `path` as JSON, atomically."""
    write_text(path, json.dumps(hparams, indent=2, sort_keys=True) + "\n")


def load(path):
    """The hparams saved at `path`, validated against today's SPEC."""
    if not os.path.isfile(path):
        raise HParamsError(f"{path}: no such file (has this logdir been trained?)")
    return resolve(_read_json(path))


class ArgumentParser(argparse.ArgumentParser):
    """argparse without prefix matching, naming the closest flag to an unknown one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--batch 8` must not silently mean a flag
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flags = [option for action in self._actions for option in action.option_strings]
            problems, after_flag = [], False
            for word in unknown:
                if word.startswith("-"):
                    match = difflib.get_close_matches(word.split("=")[0], flags, n=1)
                    hint = f" (did you mean {match[0]}?)" if match else " (see --help)"
                    problems.append(f"unknown flag {word}{hint}")
                elif not after_flag:  # a value right after an unknown flag is its value
                    problems.append(f"unexpected argument {word!r}")
                after_flag = word.startswith("-")
            self.error("; ".join(problems))
        return parsed


def argument_parser(description):
    """An `ArgumentParser` with `--hparams` plus one `--<name>` flag per hyperparameter."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--hparams", default="",
                        help="preset (" + ", ".join(PRESETS) + "), JSON file, or key=value,...")
    group = parser.add_argument_group("hyperparameters (override --hparams)")
    for name, default in DEFAULTS.items():
        group.add_argument(f"--{name}", default=None, metavar=type(default).__name__.upper(),
                           help=f"{HELP[name]} (default {default!r})")
    return parser
