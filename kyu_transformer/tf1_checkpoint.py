"""Reads a checkpoint of Kyubyong Park's TensorFlow 1.12 Transformer (his 2019 rewrite).

`layout` maps that code's variable names to this project's weight paths; `imported_weights` adds
what its model lacks; docs/import_tf1.md goes variable by variable. Everything but
`read_checkpoint` and `save_weights` runs without TensorFlow, so that import_tf1.py checks its
inputs first.
"""

import json
import os

import numpy as np

from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, UNK_ID

HPARAMS_FILE = "hparams"  # that code's hyperparameters, JSON, beside its checkpoints
EMBEDDINGS = "shared_weight_matrix/weight_mat"  # input embeddings of both sides and the logits
# Its flags that make the model, and those of training that mean the same here.
MODEL_KEYS = ("vocab_size", "d_model", "d_ff", "num_blocks", "num_heads", "maxlen1", "maxlen2")
TRAINING_KEYS = ("dropout_rate", "smoothing")
# That model in this project's terms (post-norm with layer norms, sinusoids zero at padding, one
# table read as it is, its layer-norm epsilon): --hparams must keep them.
FIXED = {"norm_position": "post", "norm_type": "layer", "fix_norm": False, "sinusoid": True,
         "share_embeddings": True, "epsilon": 1e-8}
# Adam's slots and accumulators, and the step: training state, not the model.
OPTIMIZER_NAMES = ("beta1_power", "beta2_power", "global_step")
OPTIMIZER_SUFFIXES = ("/Adam", "/Adam_1")
# (that code's scope, ours) of the attentions of an encoder and a decoder block.
ATTENTIONS = {"encoder": (("multihead_attention", "self_attention"),),
              "decoder": (("self_attention", "self_attention"),
                          ("vanilla_attention", "cross_attention"))}
PROJECTIONS = (("dense", "query_dense"), ("dense_1", "key_dense"), ("dense_2", "value_dense"))
SPECIAL_IDS = (PAD_ID, UNK_ID, BOS_ID, EOS_ID)


class TF1ImportError(ValueError):
    """Raised for a checkpoint, `hparams` file or subword model that cannot be imported; the
    message says why."""


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def read_hparams(checkpoint):
    """Reads the `hparams` file beside `checkpoint` (a prefix, or the folder of its `checkpoint`
    file); returns ``(path, values)``, or raises TF1ImportError unless `MODEL_KEYS` are all
    there."""
    folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    path = os.path.join(folder, HPARAMS_FILE)
    if not os.path.isfile(path):
        raise TF1ImportError(f"{path}: no such file (the TensorFlow 1 code writes its "
                             "hyperparameters there, beside its checkpoints)")
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TF1ImportError(f"{path}: not the JSON the TensorFlow 1 code writes ({error})") \
            from None
    if not isinstance(values, dict):
        raise TF1ImportError(f"{path}: expected a JSON object of hyperparameters")
    missing = [key for key in MODEL_KEYS if key not in values]
    if missing:
        raise TF1ImportError(f"{path}: no {', '.join(missing)} (the TensorFlow 1 code writes all "
                             "its flags there)")
    return path, values


def project_values(tf1):
    """Returns this project's hyperparameters for that code's `tf1` ones, before --hparams."""
    values = {key: tf1[key] for key in MODEL_KEYS + TRAINING_KEYS if key in tf1}
    return {**values, **FIXED, "subword_model_type": "bpe"}


def changed_fixed(hparams):
    """Returns a message for each `FIXED` setting that `hparams` changes (empty when none)."""
    return [f"`{key}` must stay {value!r} for a model of the TensorFlow 1 code, got "
            f"{hparams[key]!r}" for key, value in FIXED.items() if hparams[key] != value]


def subword_model_path(given, tf1, hparams_path):
    """Returns `given`, else the ``.model`` beside the vocabulary that `tf1`'s ``vocab`` names;
    raises TF1ImportError when there is none."""
    if given:
        return given
    vocab = tf1.get("vocab")
    if not isinstance(vocab, str) or not vocab:
        raise TF1ImportError(f"{hparams_path} names no `vocab`: give --subword_model FILE (the "
                             "code's bpe.model)")
    model = os.path.splitext(vocab)[0] + ".model"
    if not os.path.isfile(model):
        raise TF1ImportError(f"no --subword_model, and {model} (beside the `vocab` {vocab} that "
                             f"{hparams_path} names) does not exist: give --subword_model FILE "
                             "(the code's bpe.model)")
    return model


def check_subword_model(path, vocab_size):
    """Refuses a file that is not a SentencePiece model of `vocab_size` pieces with our ids;
    returns its processor."""
    import sentencepiece

    if not os.path.isfile(path):
        raise TF1ImportError(f"--subword_model {path}: no such file")
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as error:
        raise TF1ImportError(f"{path}: not a SentencePiece model ({_first_line(error)})") from None
    ids = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
    if ids != SPECIAL_IDS:
        raise TF1ImportError(f"{path}: its ids of pad, unk, BOS and EOS are {ids}, not "
                             f"{SPECIAL_IDS} as that code trains them")
    if processor.get_piece_size() != vocab_size:
        raise TF1ImportError(f"{path} has {processor.get_piece_size()} pieces but `vocab_size` "
                             f"is {vocab_size}: the subword model of another run?")
    return processor


def layout(hparams, biases):
    """Returns ``{that code's variable: (shape, our weight path)}`` for the model of `hparams`;
    `biases` says whether its attention projections have them."""
    d_model, d_ff = hparams["d_model"], hparams["d_ff"]
    names = {EMBEDDINGS: ((hparams["vocab_size"], d_model), "target_embedding/embeddings")}

    def dense(tf1, ours, shape, bias=True):
        names[f"{tf1}/kernel"] = (shape, f"{ours}/kernel")
        if bias:
            names[f"{tf1}/bias"] = (shape[1:], f"{ours}/bias")

    def norm(tf1, ours):
        for weight in ("beta", "gamma"):
            names[f"{tf1}/ln/{weight}"] = ((d_model,), f"{ours}/norm/{weight}")

    for side, attentions in ATTENTIONS.items():
        for index in range(hparams["num_blocks"]):
            tf1, ours = f"{side}/num_blocks_{index}", f"{side}_{index}"
            for scope, name in attentions:
                for theirs, projection in PROJECTIONS:
                    dense(f"{tf1}/{scope}/{theirs}", f"{ours}/{name}/{projection}",
                          (d_model, d_model), biases)
                norm(f"{tf1}/{scope}", f"{ours}/{name}")
            feed_forward = f"{tf1}/positionwise_feedforward"
            dense(f"{feed_forward}/dense", f"{ours}/feed_forward/inner_dense", (d_model, d_ff))
            dense(f"{feed_forward}/dense_1", f"{ours}/feed_forward/outer_dense", (d_ff, d_model))
            norm(feed_forward, f"{ours}/feed_forward")
    return names


def imported_weights(expected, read, hparams, biases):
    """Returns ``{our weight path: float32 array}``: the variables of `expected`
    (`check_layout`) read by `read(name)`, and those that code's model has not, set so as to
    compute the same function: each attention's output projection (identity, zero bias), and
    without `biases` its projections' (zeros)."""
    weights = {ours: np.array(read(name), dtype="float32") for name, (_, ours) in expected.items()}
    weights[expected[EMBEDDINGS][1]][PAD_ID] = 0.0  # the graph zeroes the padding row
    d_model = hparams["d_model"]
    for side, attentions in ATTENTIONS.items():
        for index in range(hparams["num_blocks"]):
            for _, name in attentions:
                prefix = f"{side}_{index}/{name}"
                weights[f"{prefix}/output_dense/kernel"] = np.eye(d_model, dtype="float32")
                weights[f"{prefix}/output_dense/bias"] = np.zeros(d_model, "float32")
                if not biases:
                    for _, projection in PROJECTIONS:
                        weights[f"{prefix}/{projection}/bias"] = np.zeros(d_model, "float32")
    return weights


def _listed(names):
    return f"`{names[0]}`" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def check_layout(where, shapes, hparams):
    """Checks a checkpoint's `shapes` (``{name: shape}``); returns ``(layout, biases,
    skipped)``, or raises TF1ImportError naming the variable that is missing, unread or of the
    wrong shape."""
    sizes = ", ".join(f"{key}={hparams[key]}" for key in MODEL_KEYS[:5])
    skipped = sorted(name for name in shapes
                     if name in OPTIMIZER_NAMES or name.endswith(OPTIMIZER_SUFFIXES))
    present = set(shapes) - set(skipped)
    if EMBEDDINGS not in present:
        holds = _listed(sorted(present)) if present else "nothing else"
        raise TF1ImportError(f"{where}: not a checkpoint of the TensorFlow 1 Transformer (no "
                             f"`{EMBEDDINGS}`; it holds {holds})")
    biases = f"encoder/num_blocks_0/{ATTENTIONS['encoder'][0][0]}/dense/bias" in present
    expected = layout(hparams, biases)
    missing = sorted(set(expected) - present)
    if missing:
        raise TF1ImportError(f"{where}: no variable {_listed(missing)}, which the model of "
                             f"{sizes} has")
    unread = sorted(present - set(expected))
    if unread:
        raise TF1ImportError(f"{where}: variable {_listed(unread)} is not in the model of {sizes}"
                             ", and would be left unread (another layout, or other hparams)")
    for name, (shape, _) in expected.items():
        if tuple(shapes[name]) != shape:
            raise TF1ImportError(f"{where}: variable `{name}` has shape {tuple(shapes[name])}, "
                                 f"not {shape} as for {sizes}")
    return expected, biases, skipped


def checkpoint_prefix(path):
    """Returns the checkpoint `path` names: itself, or the latest of the folder's `checkpoint` file
    (also when that file gives an absolute path elsewhere, as a copied folder's does)."""
    import tensorflow as tf

    if not os.path.isdir(path):
        return path
    try:
        state = tf.train.get_checkpoint_state(path)
    except Exception as error:  # pylint: disable=broad-except  (a damaged text proto)
        raise TF1ImportError(f"{path}/checkpoint: cannot be read ({error})") from None
    named = state.model_checkpoint_path if state else ""
    for candidate in (named, os.path.join(path, os.path.basename(named))):
        if named and tf.io.gfile.exists(candidate + ".index"):
            return candidate
    raise TF1ImportError(f"{path}/checkpoint names no checkpoint found there ({named!r})")


def read_checkpoint(prefix):
    """Opens the checkpoint at `prefix`; returns ``({name: shape}, read)``, where `read(name)`
    gives an array."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
        return reader.get_variable_to_shape_map(), reader.get_tensor
    except Exception as error:  # pylint: disable=broad-except  (TensorFlow's many errors)
        raise TF1ImportError(f"{prefix}: cannot be read as a checkpoint "
                             f"({_first_line(error)[:200]})") from None


def save_weights(hparams, weights, directory, step):
    """Writes a checkpoint ``<directory>/ckpt-<step>`` of the weights alone, as eval.py reads
    them (`checkpoints.load_model`); returns its path."""
    import tensorflow as tf

    from kyu_transformer import filenames
    from kyu_transformer.model import Transformer
    from kyu_transformer.training.checkpoints import model_weights

    model = Transformer.from_hparams(hparams, name="transformer")
    model.build()
    variables = model_weights(model)
    if set(variables) != set(weights):  # the mapping and the model disagree: a bug here
        raise AssertionError(f"weights of the model not written: {set(variables) - set(weights)}"
                             f"; written, not in the model: {set(weights) - set(variables)}")
    for path, variable in variables.items():
        variable.assign(weights[path])
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(weights=variables), directory,
                                         max_to_keep=1, checkpoint_name=filenames.CHECKPOINT_PREFIX)
    return manager.save(checkpoint_number=step)
