"""Defines a run's hyperparameters: every key in one table (its default, its role in a run and
its help), their types and checks (`resolve`), and the `hparams.json` a logdir keeps (`save`,
`load`).

`hparams.py`, beside the programs, holds the presets and the command line (``--hparams``, a flag
per key); the package reads the keys here, as it imports no top-level file. A key's role says
what may change it once a logdir exists:

- `ARCHITECTURE`: the weights' shapes and the subword model depend on it. A fine-tuning run takes
  the source run's value; the TensorFlow 1 import reads it from that code's checkpoint.
- `RUN`: fixed for a run's life (a resumed run must give the same), free for a fine-tuning run.
- `RESUMABLE`: may change when a run resumes: none changes the model or the data.
"""

import contextlib
import difflib
import json
import os

from kyu_transformer.conventions import (
    EMBEDDING_INITS, LAYER_NORM_EPSILON, NORM_POSITIONS, NORM_TYPES, check_choice, check_decay,
    check_heads, check_rates)
from kyu_transformer.precision import AUTO, PRECISION_POLICIES
from kyu_transformer.safety.writes import write_text

ARCHITECTURE, RUN, RESUMABLE = "architecture", "run", "resumable"

# name: (default, role, help). Kyubyong's names where they exist.
SPEC = {
    # data
    "data_dir": ("data/multi30k", RUN, "folder with train/val/test files <split>.<lang>[.gz]"),
    "src_lang": ("de", RUN, "source language suffix"),
    "tgt_lang": ("en", RUN, "target language suffix"),
    "corpus_cache": ("", RESUMABLE,
                     "folder where the training split is prepared once (subword ids on disk), "
                     "which runs of the same corpus and subword model share; empty: "
                     "<logdir>/prepared"),
    "vocab_size": (8000, ARCHITECTURE, "size of the joint SentencePiece vocabulary"),
    "subword_model_type": ("unigram", ARCHITECTURE, "SentencePiece model type: unigram or bpe"),
    "subword_alpha": (0.0, RUN,
                      "subword regularization (unigram only): each epoch draws a training "
                      "sentence's segmentation among its 16 best, ~ p^alpha; 0: the best"),
    "maxlen1": (100, ARCHITECTURE,
                "longest source, in subwords with EOS; longer pairs are dropped"),
    "maxlen2": (100, ARCHITECTURE,
                "longest target, in subwords with BOS/EOS; longer pairs are dropped"),
    "bidirectional_epochs": (0, RUN,
                             "BiT: the first N epochs train on every pair both ways (source to "
                             "target and target to source, one vocabulary), the others source "
                             "to target; 0: off"),
    "batch_size": (128, RUN, "most sentence pairs in a batch"),
    "batch_tokens": (4096, RUN, "most (padded) tokens on either side of a batch; 0: no limit"),
    # model
    "d_model": (512, ARCHITECTURE, "model width"),
    "d_ff": (2048, ARCHITECTURE, "inner width of the feed-forward nets"),
    "num_blocks": (6, ARCHITECTURE, "encoder blocks, and as many decoder blocks"),
    "num_heads": (8, ARCHITECTURE, "attention heads"),
    "dropout_rate": (0.1, RUN, "dropout on the embeddings and before each residual sum"),
    "attention_dropout": (-1.0, RUN, "dropout on the attention weights; -1: dropout_rate"),
    "relu_dropout": (0.0, RUN, "dropout on the feed-forward nets' inner (ReLU) activations"),
    "word_dropout": (0.0, RUN, "dropout of whole token embeddings, source and target"),
    "layer_dropout": (0.0, RUN,
                      "LayerDrop: in training, each encoder and decoder block dropped whole (its "
                      "input passed on) with this probability, drawn per block and batch; the "
                      "blocks are computed either way"),
    "norm_position": (NORM_POSITIONS[0], ARCHITECTURE,
                      "each normalization after (post) or before (pre) its sub-layer"),
    "norm_type": (NORM_TYPES[0], ARCHITECTURE,
                  "each normalization a layer norm (layer) or a ScaleNorm (scale: the vector "
                  "scaled to one learned length; with pre, 'Transformers without Tears')"),
    "fix_norm": (False, ARCHITECTURE,
                 "FixNorm: every embedding row read at length 1, so the logits are the final "
                 "state's length times cosines"),
    "embedding_init": (EMBEDDING_INITS[0], RUN,
                       "how the embedding table starts: glorot (the original's Xavier uniform) "
                       "or normal (standard deviation 1/sqrt(d_model))"),
    "sinusoid": (True, ARCHITECTURE, "sinusoid (true) or learned (false) positions"),
    "share_embeddings": (True, ARCHITECTURE, "one embedding table for source, target and output"),
    "epsilon": (LAYER_NORM_EPSILON, ARCHITECTURE,
                "epsilon of every normalization (added to the variance of a layer norm, to the "
                "squared length of a ScaleNorm)"),
    "fast_paths": (True, RESUMABLE,
                   "CPU fast paths (fast_paths.py, the loss's stated gradient, fused Adam, XLA "
                   "loss); false: Keras' own, the same function on any device"),
    # training
    "lr": (1.0, RUN, "scale of the Noam learning-rate schedule"),
    "warmup_steps": (4000, RUN, "warm-up steps of the Noam schedule"),
    "decay_steps": (0, RUN,
                    "from the warm-up's end, scale the Noam rate down linearly to 0 at this step; "
                    "0: no such decay"),
    "smoothing": (0.1, RUN, "label smoothing"),
    "num_epochs": (20, RESUMABLE, "epochs to train"),
    "steps_per_epoch": (0, RESUMABLE,
                        "cap on the steps (updates) of an epoch; 0: the whole training set"),
    "accumulate_steps": (1, RUN,
                         "batches per update (gradient accumulation), as one batch that many "
                         "times as large: the loss normalized by all their tokens"),
    "max_minutes": (0.0, RESUMABLE,
                    "stop cleanly after this many minutes of training; 0: no limit"),
    "seed": (42, RUN, "seed of initialization, shuffling and dropout"),
    "mixed_precision": ("no", RUN,
                        "no, bf16 (CPU/TPU), fp16 (GPU, with loss scaling), or auto: chosen for "
                        "this machine (docs/training.md) and saved as chosen"),
    "jit_compile": (False, RESUMABLE,
                    "compile each replica's update with XLA (under several replicas its forward "
                    "and backward passes); once per batch shape, a few per bucket"),
    "xla_loss": (True, RESUMABLE,
                 "compile the loss alone with XLA, once per batch shape: it fuses the passes "
                 "over the (tokens, vocabulary) logits into one, which saves memory traffic on "
                 "a GPU and a CPU alike, while the matrix products keep TensorFlow's kernels (a "
                 "fast path: off without fast_paths; within jit_compile's XLA already)"),
    "logdir": ("log/default", RESUMABLE,
               "where checkpoints, summaries, plots and the subword model go"),
    "keep_checkpoints": (5, RESUMABLE, "how many recent checkpoints to keep"),
    "checkpoint_every": (500, RESUMABLE,
                         "also checkpoint every this many steps; 0: only per epoch"),
    "log_every": (50, RESUMABLE, "write summaries every this many steps"),
    # evaluation during training
    "eval_sentences": (200, RESUMABLE,
                       "validation sentences scored with BLEU after each epoch; 0: none"),
    "eval_batch_size": (128, RESUMABLE, "sentences per decoding batch"),
}

DEFAULTS = {name: default for name, (default, _, _) in SPEC.items()}
HELP = {name: text for name, (_, _, text) in SPEC.items()}


def keys_of(role):
    """Returns the keys of `role`, in the table's order."""
    return tuple(name for name, (_, key_role, _) in SPEC.items() if key_role == role)


CHOICES = {"norm_position": NORM_POSITIONS, "norm_type": NORM_TYPES,
           "embedding_init": EMBEDDING_INITS, "mixed_precision": (*PRECISION_POLICIES, AUTO),
           "subword_model_type": ("unigram", "bpe")}
POSITIVE = ("vocab_size", "maxlen1", "maxlen2", "batch_size", "d_model", "d_ff", "num_blocks",
            "num_heads", "lr", "warmup_steps", "num_epochs", "keep_checkpoints", "log_every",
            "epsilon", "eval_batch_size", "accumulate_steps")
NON_NEGATIVE = ("batch_tokens", "steps_per_epoch", "max_minutes", "checkpoint_every",
                "eval_sentences", "seed", "subword_alpha", "decay_steps", "bidirectional_epochs")
RATES = ("dropout_rate", "smoothing", "relu_dropout", "word_dropout", "layer_dropout")


class HParamsError(ValueError):
    """Raised for bad hyperparameters; the message lists every problem found."""


def closest(name, names=SPEC):
    """Returns a hint naming the entry of `names` closest to `name`, or "" when none is close."""
    match = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean `{match[0]}`?)" if match else ""


def _convert(name, value):
    """Converts `value` (a string from the command line, or a JSON value) to the type of `name`;
    raises HParamsError."""
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


def read_json(path):
    """Reads the JSON object at `path`; raises HParamsError for invalid JSON or another value."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except json.JSONDecodeError as error:
        raise HParamsError(f"{path}, line {error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(values, dict):
        raise HParamsError(f"{path}: expected a JSON object of hyperparameters")
    return values


def resolve(values):
    """Returns DEFAULTS updated with `values`, converted and validated; raises HParamsError."""
    problems = []
    hparams = dict(DEFAULTS)
    for name, value in values.items():
        if name not in SPEC:
            problems.append(f"unknown hyperparameter `{name}`{closest(name)}; "
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
    """Returns the list of problems of a fully typed hparams dict (empty when valid)."""
    ranges = ((POSITIVE, lambda value: value > 0, "positive"),
              (NON_NEGATIVE, lambda value: value >= 0, ">= 0"),
              (("attention_dropout",), lambda value: value == -1.0 or 0.0 <= value < 1.0,
               "in [0, 1) or -1 (as dropout_rate)"))
    problems = [f"`{name}` must be {text}, got {hparams[name]}"
                for names, valid, text in ranges for name in names if not valid(hparams[name])]
    problems += [problem for name in RATES
                 for problem in _broken(check_rates, **{name: hparams[name]})]
    problems += [problem for name, choices in CHOICES.items()
                 for problem in _broken(check_choice, name, hparams[name], choices)]
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


def _broken(rule, *args, **kwargs):
    """Returns the message of the ValueError that `rule(*args)` raises (without its full stop) as
    a list, empty when it raises none."""
    try:
        rule(*args, **kwargs)
    except ValueError as error:
        return [str(error).rstrip(".")]
    return []


def save(hparams, path):
    """Writes `hparams` to `path` as JSON, atomically."""
    write_text(path, json.dumps(hparams, indent=2, sort_keys=True) + "\n")


def load(path):
    """Reads the hparams saved at `path`, validated against today's SPEC."""
    if not os.path.isfile(path):
        raise HParamsError(f"{path}: no such file (has this logdir been trained?)")
    return resolve(read_json(path))
