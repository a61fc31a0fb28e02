"""A trained `Transformer` as a CTranslate2 model, and translation with it.

`convert` fills CTranslate2's own Transformer specification
(`ctranslate2.specs.TransformerSpec`) with the model's weights and writes a
model directory that `ctranslate2.Translator` loads. What the specification
does not assume by itself is set from the model:

- the positional encodings: CTranslate2's built-in sinusoid is the
  concatenated (tensor2tensor) layout counted from position 1, ours is
  interleaved and counted from 0 by default; the model's own tables are
  written instead (``maxlen1`` rows for the encoder, ``maxlen2`` for the
  decoder: they bound the source and the output as they bound ours, and
  CTranslate2 refuses a longer input rather than reading past them);
- the embedding scale ``sqrt(d_model)`` and the zero padding row;
- post- or pre-norm (with the final normalization of each pre-norm stack);
- the layer-norm epsilon (CTranslate2's own default is 1e-5, hparams' 1e-6);
- the tied output layer (the target table) and the one vocabulary of the
  subword model, pieces in id order, with its own names for the unknown,
  start and end tokens (``<unk>``, ``<s>``, ``</s>``).

The source's EOS is not added by CTranslate2 (``add_source_eos`` is false):
the caller appends ``</s>`` and cuts to ``maxlen1`` as `decoding.Translator`
does, ``(pieces + ["</s>"])[:maxlen1]``. A source longer than the encoder's
table then loses its EOS, as in our Translator; CTranslate2's own cut
(``max_input_length``) would keep the EOS and drop one more piece instead, so
with ``add_source_eos`` no long sentence could translate as ours does.

`translate_with_ctranslate2` translates the way `decoding.Translator` does
(same source cut, same per-sentence output limit, empty outputs allowed) and
can return per-token log-probabilities. ctranslate2 is an optional
dependency (``pip install -e ".[serve]"``), imported only when a function
here needs it.
"""

import collections
import json
import os
import shutil
import uuid

import keras
import numpy as np

# Named apart: `length_penalty` is also CTranslate2's own option in this module.
from kyu_transformer.decoding import length_penalty as gnmt_penalty
from kyu_transformer.decoding import output_limit
from kyu_transformer.layers import ScaledDotProductAttention, sinusoid_table
from kyu_transformer.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID

# The weight types of CTranslate2's CPU wheel.
QUANTIZATIONS = ("float32", "int8", "int8_float32")
# Feed-forward activations by Keras name, and CTranslate2's name of each
# (`ctranslate2.specs.Activation`; Keras' gelu is the exact, erf one).
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "silu": "SWISH", "swish": "SWISH"}
# Our settings that CTranslate2's config.json has no place for.
SETTINGS_FILE = "kyu_transformer.json"
# The subword model, copied beside the weights: the directory is all a user needs.
SUBWORDS_FILE = "subwords.model"


class ExportError(ValueError):
    """A model or option CTranslate2 cannot take; the message names the setting."""


def _import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise ImportError('The CTranslate2 export needs the ctranslate2 package: '
                          'pip install -e ".[serve]" (or pip install ctranslate2)') from None
    return ctranslate2


def _array(variable):
    """A weight as a float32 numpy array (variables are float32 under mixed precision too)."""
    return np.ascontiguousarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)


# ----------------------------------------------------------------- checking

def _activation_name(function):
    return getattr(function, "__name__", str(function))


def unsupported_settings(model, hparams=None):
    """What of `model` CTranslate2's Transformer cannot represent.

    Args:
      model: A `Transformer` (built here if it is not yet).
      hparams: Optional dict of hyperparameters; its ``epsilon`` must be the
        model's.

    Returns:
      A list of messages, each naming the setting (empty: it can be converted).
    """
    if not model.built:
        model.build()
    problems = []
    epsilon = model.epsilon if hparams is None else hparams.get("epsilon", model.epsilon)
    if not np.isclose(epsilon, model.epsilon, rtol=1e-6, atol=0):
        problems.append(f"`epsilon` is {epsilon} in hparams but {model.epsilon} in the model")
    for block in model.encoder_blocks + model.decoder_blocks:
        attentions = [block.self_attention]
        if hasattr(block, "cross_attention"):
            attentions.append(block.cross_attention)
        for attention in attentions:
            where = f"{block.name}/{attention.name}"
            activation = _activation_name(attention.projection_activation)
            if activation != "linear":
                problems.append(
                    f"{where}: `projection_activation={activation!r}`: CTranslate2's attention "
                    "projections are linear")
            widths = {dense.units for dense in (attention.query_dense, attention.key_dense,
                                                attention.value_dense)}
            if widths != {model.d_model}:
                problems.append(
                    f"{where}: `num_units` (query/key/value widths {sorted(widths)}, not "
                    f"d_model={model.d_model}): CTranslate2 splits d_model into the heads")
            if not attention.output_projection:
                problems.append(f"{where}: `output_projection=False`: CTranslate2's attention "
                                "always ends with an output projection")
            operator = attention.attention
            if type(operator) is not ScaledDotProductAttention or operator.temperature:
                problems.append(
                    f"{where}: `attention={type(operator).__name__}"
                    f"(temperature={getattr(operator, 'temperature', None)})`: CTranslate2 "
                    "computes softmax(Q K^T / sqrt(d_k)) V only")
        activation = _activation_name(block.feed_forward.activation)
        if activation not in ACTIVATIONS:
            problems.append(
                f"{block.name}/feed_forward: `activation={activation!r}`: CTranslate2 takes "
                f"{', '.join(ACTIVATIONS)}")
    for layer in _norm_layers(model):
        if not np.isclose(layer.epsilon, model.epsilon, rtol=1e-6, atol=0):
            problems.append(f"{layer.path}: `epsilon={layer.epsilon}` differs from the model's "
                            f"{model.epsilon}: CTranslate2 has one epsilon for every "
                            "normalization")
        if layer.rms_scaling:
            problems.append(f"{layer.path}: `rms_scaling=True`: CTranslate2's Transformer "
                            "normalizes with mean and variance")
    for name in ("source_embedding", "target_embedding"):
        embedding = getattr(model, name)
        if embedding.vocab_size != model.vocab_size or embedding.num_units != model.d_model:
            problems.append(f"{name}: `num_units={embedding.num_units}` / `vocab_size="
                            f"{embedding.vocab_size}` differ from the model's")
    return problems


def _norm_layers(model):
    layers = []
    for block in model.encoder_blocks + model.decoder_blocks:
        layers += [block.self_attention.norm, block.feed_forward.norm]
        if hasattr(block, "cross_attention"):
            layers.append(block.cross_attention.norm)
    if model.norm_position == "pre":
        layers += [model.encoder_norm, model.decoder_norm]
    return layers


# ------------------------------------------------------------ the weights

def _embedding_table(embedding):
    """The lookup table as the model reads it: float32, padding row zero if `zero_pad`."""
    table = _array(embedding.embeddings)
    if embedding.zero_pad:
        table[PAD_ID] = 0.0
    return table


def _position_table(positions, width):
    """`(maxlen, C)` encodings as the model adds them, for positions 0, 1, ..."""
    if positions.sinusoid:
        table = sinusoid_table(positions.maxlen, width, positions.style)
    else:
        table = _array(positions.position_embeddings)
    table = np.array(table, dtype=np.float32)
    if positions.zero_pad:
        table[0] = 0.0
    if positions.scale:
        table *= np.float32(np.sqrt(width))
    return table


def _set_linear(spec, dense):
    spec.weight = np.ascontiguousarray(_array(dense.kernel).T)  # (out, in)
    if dense.use_bias:
        spec.bias = _array(dense.bias)


def _set_fused_linear(spec, denses):
    """One CTranslate2 linear layer of several of ours side by side (fused Q/K/V)."""
    spec.weight = np.ascontiguousarray(np.concatenate([_array(d.kernel).T for d in denses]))
    if any(d.use_bias for d in denses):
        spec.bias = np.concatenate(
            [_array(d.bias) if d.use_bias else np.zeros(d.units, np.float32) for d in denses])


def _set_layer_norm(spec, layer):
    width = layer.gamma.shape[0] if layer.scale else layer.beta.shape[0]
    spec.gamma = _array(layer.gamma) if layer.scale else np.ones(width, np.float32)
    spec.beta = _array(layer.beta) if layer.center else np.zeros(width, np.float32)


def _set_attention(spec, attention, self_attention):
    if self_attention:
        _set_fused_linear(spec.linear[0], [attention.query_dense, attention.key_dense,
                                           attention.value_dense])
    else:
        _set_linear(spec.linear[0], attention.query_dense)
        _set_fused_linear(spec.linear[1], [attention.key_dense, attention.value_dense])
    _set_linear(spec.linear[-1], attention.output_dense)
    _set_layer_norm(spec.layer_norm, attention.norm)


def _set_feed_forward(spec, feed_forward):
    _set_linear(spec.linear_0, feed_forward.inner_dense)
    _set_linear(spec.linear_1, feed_forward.outer_dense)
    _set_layer_norm(spec.layer_norm, feed_forward.norm)


def _set_inputs(spec, embedding, positions, width):
    table = _embedding_table(embedding)
    (spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings).weight = table
    spec.scale_embeddings = embedding.scale  # True: times sqrt(d_model), as ours
    spec.position_encodings.encodings = _position_table(positions, width)
    return table


def build_spec(model, hparams, subwords):
    """CTranslate2's `TransformerSpec` of `model`, filled with its weights.

    Args:
      model: A `Transformer` with its weights (built here if it is not yet).
      hparams: The hyperparameters (``epsilon`` is read from them).
      subwords: The `data.Subwords` the model was trained with.

    Returns:
      The specification, validated, not yet optimized or saved.

    Raises:
      ExportError: naming what CTranslate2 cannot represent.
    """
    _import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    problems = unsupported_settings(model, hparams)
    pieces = _vocabulary(subwords)
    if len(pieces) != model.vocab_size:
        problems.append(f"`vocab_size`: the model has {model.vocab_size} ids but the subword "
                        f"model {len(pieces)} pieces")
    if problems:
        raise ExportError("CTranslate2 cannot represent this model:\n  - "
                          + "\n  - ".join(problems))
    activation = _activation_name(model.encoder_blocks[0].feed_forward.activation)
    spec = transformer_spec.TransformerSpec.from_config(
        model.num_blocks, model.num_heads, pre_norm=model.norm_position == "pre",
        activation=getattr(common_spec.Activation, ACTIVATIONS[activation]))

    encoder, decoder = spec.encoder, spec.decoder
    _set_inputs(encoder, model.source_embedding, model.source_positions, model.d_model)
    for layer_spec, block in zip(encoder.layer, model.encoder_blocks):
        _set_attention(layer_spec.self_attention, block.self_attention, self_attention=True)
        _set_feed_forward(layer_spec.ffn, block.feed_forward)
    target_table = _set_inputs(decoder, model.target_embedding, model.target_positions,
                               model.d_model)
    for layer_spec, block in zip(decoder.layer, model.decoder_blocks):
        _set_attention(layer_spec.self_attention, block.self_attention, self_attention=True)
        _set_attention(layer_spec.attention, block.cross_attention, self_attention=False)
        _set_feed_forward(layer_spec.ffn, block.feed_forward)
    # Tied output weights: the logits are the decoder states times the target table.
    decoder.projection.weight = target_table
    if model.norm_position == "pre":
        _set_layer_norm(encoder.layer_norm, model.encoder_norm)
        _set_layer_norm(decoder.layer_norm, model.decoder_norm)

    config = spec.config
    config.layer_norm_epsilon = float(hparams.get("epsilon", model.epsilon))
    config.unk_token = pieces[UNK_ID]
    config.bos_token = pieces[BOS_ID]
    config.eos_token = pieces[EOS_ID]
    config.decoder_start_token = pieces[BOS_ID]
    # EOS is appended to the source by whoever cuts it (see the module's
    # docstring): CTranslate2's own cut would keep it where ours drops it.
    config.add_source_bos = False
    config.add_source_eos = False
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.validate()
    return spec


def _vocabulary(subwords):
    """The subword model's pieces in id order, checked against our special ids."""
    processor = subwords.processor
    expected = {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID}
    for name, value in expected.items():
        if getattr(processor, name)() != value:
            raise ExportError(f"the subword model's `{name}` is {getattr(processor, name)()}, "
                              f"but the model was trained with {value}")
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def check_quantization(quantization):
    """Raises ExportError unless `quantization` is one of `QUANTIZATIONS`."""
    if quantization not in QUANTIZATIONS:
        raise ExportError(f"`quantization` must be one of {', '.join(QUANTIZATIONS)} (the weight "
                          f"types of CTranslate2's CPU wheel), got {quantization!r}")


def convert(model, hparams, subwords, out_dir, quantization="float32"):
    """Writes `model` as a CTranslate2 model directory.

    The directory holds CTranslate2's ``model.bin``, ``config.json`` and
    ``shared_vocabulary.json``, plus the subword model (`SUBWORDS_FILE`) and
    our settings that CTranslate2 does not keep (`SETTINGS_FILE`: ``maxlen1``,
    ``maxlen2``). It is written beside `out_dir` and renamed into place, so
    `out_dir` is either complete or absent.

    Args:
      model: A built `Transformer` with its trained weights (any compute
        dtype: the float32 variables are written).
      hparams: The dict of hparams.json (``epsilon`` is read from it).
      subwords: The `data.Subwords` the model was trained with.
      out_dir: The directory to write; must not exist or be empty.
      quantization: CTranslate2's weight type: ``float32``, ``int8`` or
        ``int8_float32``.

    Returns:
      `out_dir`.

    Raises:
      ExportError: a setting CTranslate2 cannot represent, an unknown
        `quantization`, or a non-empty `out_dir`.
    """
    check_quantization(quantization)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ExportError(f"{out_dir}: already exists and is not an empty directory")
    spec = build_spec(model, hparams, subwords)
    spec.optimize(quantization=quantization)
    spec.register_file(subwords.path, SUBWORDS_FILE)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # Made with mode 0o777, which the process umask reduces as for any new folder
    # (mkdtemp's 0o700 would follow the rename; the umask is never changed to be read).
    staging = os.path.join(parent, f".ctranslate2-{uuid.uuid4().hex}")
    os.mkdir(staging, 0o777)
    try:
        spec.save(staging)
        settings = {"maxlen1": model.maxlen1, "maxlen2": model.maxlen2,
                    "norm_position": model.norm_position, "epsilon": spec.config.layer_norm_epsilon,
                    "quantization": quantization}
        with open(os.path.join(staging, SETTINGS_FILE), "w", encoding="utf-8") as handle:
            json.dump(settings, handle, indent=2, sort_keys=True)
            handle.write("\n")
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# ------------------------------------------------------------- translating

class Hypothesis(collections.namedtuple("Hypothesis", "ids score log_prob log_probs truncated")):
    """One translation from `translate_with_ctranslate2`.

    `ids`: the output's subword ids (EOS and padding removed); `log_prob`:
    its log-probability, EOS included; `score`: `log_prob` divided by GNMT's
    length penalty ``((5 + length) / 6) ** alpha`` of its length (EOS
    included), as our beam search scores; `log_probs`: one log-probability per
    generated token, EOS included (None unless asked for); `truncated`: the
    output stopped at its limit without EOS.
    """


def read_settings(model_dir):
    """Our settings written beside a converted model (`SETTINGS_FILE`), as a dict."""
    path = os.path.join(model_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        raise ExportError(f"{model_dir}: no {SETTINGS_FILE}; was it written by "
                          "kyu_transformer.ctranslate2_export.convert?")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_vocabulary(model_dir):
    """The pieces of a converted model's shared vocabulary, in id order."""
    with open(os.path.join(model_dir, "shared_vocabulary.json"), encoding="utf-8") as handle:
        return json.load(handle)


def _log_softmax(logits):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def translate_with_ctranslate2(model_dir, sources, beam_size=1, alpha=0.6, length_margin=16,
                               maxlen1=None, maxlen2=None, n_best=1, max_length=None,
                               return_log_probs=False, translator=None, batch_size=64,
                               length_penalty=None, patience=1.0):
    """Translates with a converted model the way `decoding.Translator` does.

    Each source gets ``</s>`` and is cut to `maxlen1`, as our encoder input;
    each sentence's output limit (EOS included) is `output_limit` of its
    source. ``translate_batch`` takes one limit per call, so sentences are
    decoded in groups of equal limit (which sentences share a call changes no
    output). Empty sources give one empty hypothesis, undecoded.

    Options map to ``translate_batch`` as follows:

    - the limit to ``max_decoding_length`` (CTranslate2 counts EOS in it too),
      ``min_decoding_length=0`` (CTranslate2 would otherwise never end an
      output before one token), ``max_input_length=0`` (cut here);
    - `beam_size` and `n_best` (``num_hypotheses``, at most `beam_size`);
    - greedy search (``beam_size=1``): ``length_penalty=0``, so that
      CTranslate2's score is the plain log-probability, EOS included;
    - beam search: ``length_penalty=alpha`` (or `length_penalty`) with
      ``return_end_token=True``. CTranslate2 ranks finished hypotheses by
      ``log p / length ** length_penalty`` where we divide by GNMT's
      ``((5 + length) / 6) ** alpha``; both count EOS in the length (that is
      what ``return_end_token`` does for the ranking), and both orders agree
      between hypotheses of equal length, but CTranslate2's favours longer
      ones more. The stop rules differ too: CTranslate2 takes a hypothesis as
      finished only when EOS is among the `beam_size` best of its
      ``2 * beam_size`` candidates (ours: among all of them), and ends a
      sentence once ``beam_size * patience`` hypotheses have finished (with
      ``length_penalty=0``, as soon as the best one has), where ours ends it
      when no live hypothesis can beat the worst finished one even at the
      sentence's limit. At the limit both finish every live hypothesis
      without EOS. Beam outputs may therefore differ from ours; greedy ones
      do not.

    Args:
      model_dir: A directory written by `convert`.
      sources: Lists of subword ids, or of subword pieces (strings; pieces
        outside the vocabulary read as ``<unk>``, as CTranslate2 maps them),
        without EOS.
      beam_size: 1 for greedy search.
      alpha: Our length-penalty exponent (see above).
      length_margin: How many tokens an output may have beyond its source's.
      maxlen1, maxlen2: The model's limits; default those in `SETTINGS_FILE`.
      n_best: Hypotheses per sentence, best first (CTranslate2's order).
      max_length: Most output tokens of any sentence; default `maxlen2`.
      return_log_probs: Also give each output's per-token log-probabilities
        (greedy search only: they come from the logits CTranslate2 returns
        with ``return_logits_vocab``, which its beam search does not fill
        reliably).
      translator: A ``ctranslate2.Translator`` of `model_dir` already loaded;
        default one loaded here (CPU, the model's own weight type).
      batch_size: Most sentences per ``translate_batch`` batch.
      length_penalty: CTranslate2's exponent for beam search; default `alpha`.
      patience: CTranslate2's beam-search patience factor.

    Returns:
      One list of `n_best` `Hypothesis` per source, in the order given; an
      empty source has one, empty and scored 0.

    Raises:
      ValueError: naming an option out of range.
    """
    ctranslate2 = _import_ctranslate2()
    if maxlen1 is None or maxlen2 is None:
        settings = read_settings(model_dir)
        maxlen1 = settings["maxlen1"] if maxlen1 is None else maxlen1
        maxlen2 = settings["maxlen2"] if maxlen2 is None else maxlen2
    max_length = maxlen2 if max_length is None else max_length
    if beam_size < 1:
        raise ValueError(f"`beam_size` must be at least 1, got {beam_size}")
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"`n_best` ({n_best}) must be in [1, beam_size={beam_size}]: the "
                         "search keeps only `beam_size` hypotheses")
    if not 1 <= max_length <= maxlen2:
        raise ValueError(f"`max_length` must be in [1, {maxlen2}] (the model's maxlen2), "
                         f"got {max_length}")
    if length_margin < 0:
        raise ValueError(f"`length_margin` must be at least 0, got {length_margin}")
    if return_log_probs and beam_size > 1:
        raise ValueError(f"`return_log_probs` needs greedy search, but `beam_size` is "
                         f"{beam_size}: CTranslate2 returns no usable logits from beam search")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}")
    if translator is None:
        translator = ctranslate2.Translator(model_dir, device="cpu")
    pieces = read_vocabulary(model_dir)
    ids_of = {piece: i for i, piece in enumerate(pieces)}
    eos = pieces[EOS_ID]

    # An empty source is not decoded: one empty hypothesis, scored 0 (as Translator).
    results = [[Hypothesis([], 0.0, 0.0, [] if return_log_probs else None, False)]
               for _ in sources]
    groups = collections.defaultdict(list)  # limit: indices of its sources
    inputs = {}
    for index, source in enumerate(sources):
        if len(source) == 0:
            continue
        tokens = [pieces[i] if isinstance(i, (int, np.integer)) else i for i in source]
        inputs[index] = (tokens + [eos])[:maxlen1]  # the encoder's input, as ours
        groups[int(output_limit(len(source), maxlen1, max_length, length_margin))].append(index)

    greedy = beam_size == 1
    for limit, indices in sorted(groups.items()):
        outputs = translator.translate_batch(
            [inputs[i] for i in indices], beam_size=beam_size, num_hypotheses=n_best,
            length_penalty=0.0 if greedy else (alpha if length_penalty is None
                                               else length_penalty),
            patience=patience, max_batch_size=batch_size, max_input_length=0,
            max_decoding_length=limit, min_decoding_length=0, return_end_token=True,
            return_scores=True, return_logits_vocab=return_log_probs)
        for index, output in zip(indices, outputs):
            results[index] = [
                _hypothesis(output, k, ids_of, alpha, greedy, return_log_probs,
                            alpha if length_penalty is None else length_penalty)
                for k in range(n_best)]
    return results


def _hypothesis(output, k, ids_of, alpha, greedy, return_log_probs, length_penalty):
    """Our `Hypothesis` of the `k`-th hypothesis of a ``TranslationResult``."""
    tokens = [ids_of.get(piece, UNK_ID) for piece in output.hypotheses[k]]
    ended = bool(tokens) and tokens[-1] == EOS_ID
    length = len(tokens)  # EOS included
    # CTranslate2's score is the log-probability divided by its own penalty.
    log_prob = output.scores[k] * (1.0 if greedy else max(length, 1) ** length_penalty)
    log_probs = None
    if return_log_probs:
        log_probs = [float(_log_softmax(np.asarray(logits))[token])
                     for logits, token in zip(output.logits[k], tokens)]
    ids = [i for i in (tokens[:-1] if ended else tokens) if i != PAD_ID]
    return Hypothesis(ids, log_prob / float(gnmt_penalty(length, alpha)), log_prob, log_probs,
                      not ended)
