"""Reads the hyperparameters as the programs take them: from the presets and the command line.

Every key (its default, its role and its help), its checks and the `hparams.json` of a logdir are
defined once, in `kyu_transformer.config`.

``--hparams`` joins presets, JSON files and ``key=value`` parts by commas, later ones winning
(``--hparams small,lr=2.0``); single flags (``--batch_size 64``) override them all.
"""

import argparse
import difflib
import os

from kyu_transformer.config import DEFAULTS, HELP, SPEC, HParamsError, closest, read_json, resolve

PRESETS = {
    # For tests and smoke runs. No `xla_loss`: in a few dozen updates, compiling the loss
    # once for each of the first batch shapes costs more than the fused loss saves.
    "tiny": dict(vocab_size=400, d_model=32, d_ff=64, num_blocks=1, num_heads=2,
                 maxlen1=48, maxlen2=48, batch_size=32, batch_tokens=1024, dropout_rate=0.0,
                 lr=2.0, warmup_steps=40, num_epochs=1, steps_per_epoch=30, log_every=10,
                 checkpoint_every=0, eval_sentences=0, xla_loss=False, logdir="log/tiny"),
    # The CPU recipe for Multi30k, chosen on val within the compute of the recipe before it
    # (d_model 256, 3 + 3 blocks, 4,500 updates; benchmarks/RESULTS.md, "Recipe search"): a
    # narrower, deeper model trained over three times as many updates, pre-norm with ScaleNorm
    # and FixNorm at a high rate, the first 16 epochs on the pairs both ways (BiT);
    # `decay_steps` brings the rate to 0 at the 14,186th update, the last.
    "small": dict(vocab_size=8000, d_model=128, d_ff=256, num_blocks=4, num_heads=4,
                  maxlen1=64, maxlen2=64, batch_size=256, batch_tokens=4096, dropout_rate=0.3,
                  attention_dropout=0.0, norm_position="pre", norm_type="scale", fix_norm=True,
                  lr=2.53, warmup_steps=2000, decay_steps=14186, num_epochs=79,
                  bidirectional_epochs=16, mixed_precision="auto", checkpoint_every=100,
                  keep_checkpoints=16, logdir="log/small"),
    # The paper's base model.
    "base": dict(d_model=512, d_ff=2048, num_blocks=6, num_heads=8, dropout_rate=0.1,
                 lr=1.0, warmup_steps=4000, mixed_precision="auto", logdir="log/base"),
}


def _parse_part(part):
    """Reads one comma-separated part of `--hparams`: a preset, a JSON file or key=value."""
    if "=" in part:
        key, value = part.split("=", 1)
        return {key.strip(): value}
    if part in PRESETS:
        return dict(PRESETS[part])
    if part.endswith(".json") or os.path.sep in part:
        if not os.path.isfile(part):
            raise HParamsError(f"--hparams: no such JSON file: {part}")
        return read_json(part)
    raise HParamsError(f"--hparams: {part!r} is neither a preset ({', '.join(PRESETS)})"
                       f"{closest(part, PRESETS)}, a JSON file nor key=value")


def _given(spec="", overrides=None):
    """Returns the values a `--hparams` string and overrides give (later ones winning),
    unconverted."""
    values = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        values.update(_parse_part(part))
    values.update(overrides or {})
    return values


def parse(spec="", overrides=None):
    """Resolves a `--hparams` string and a dict of overrides into validated hparams."""
    return resolve(_given(spec, overrides))


def _overrides(args):
    return {name: getattr(args, name) for name in SPEC if getattr(args, name) is not None}


def from_args(args):
    """Returns the hparams given by parsed `argument_parser` flags."""
    return parse(args.hparams, _overrides(args))


def given_keys(args):
    """Returns the names the flags set (by a preset, a JSON file, key=value or a flag), not those
    defaulted."""
    return set(_given(args.hparams, _overrides(args)))


class ArgumentParser(argparse.ArgumentParser):
    """Parses as argparse does, without prefix matching, and names the closest flag to an
    unknown one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--batch 8` must not silently mean a flag
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """Parses `args`; stops with one error that names every unknown flag and unexpected
        argument."""
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
    """Returns an `ArgumentParser` with `--hparams` plus one `--<name>` flag per hyperparameter."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--hparams", default="",
                        help="preset (" + ", ".join(PRESETS) + "), JSON file, or key=value,...")
    group = parser.add_argument_group("hyperparameters (override --hparams)")
    for name, default in DEFAULTS.items():
        group.add_argument(f"--{name}", default=None, metavar=type(default).__name__.upper(),
                           help=f"{HELP[name]} (default {default!r})")
    return parser
