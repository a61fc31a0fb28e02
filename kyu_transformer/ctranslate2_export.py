"""A trained `Transformer` as a CTranslate2 model, and translation with it.

`convert` fills CTranslate2's `TransformerSpec` with the model's weights. What the spec does not
assume is set from the model: the position tables themselves (CTranslate2's built-in sinusoid is
the concatenated layout from position 1; ours is interleaved from 0; ``maxlen1``/``maxlen2`` rows
bound the inputs as they bound ours), the embedding scale and zero padding row, post- or pre-norm,
the layer-norm epsilon, the tied output layer, and the subword model's one vocabulary.

The source's EOS is appended by the front end (`translation.encoder_inputs`:
``(pieces + ["</s>"])[:maxlen1]``, so a long source loses its EOS as in `Translator`), not by
CTranslate2 (``add_source_eos`` false), whose own cut would keep it and drop a piece instead.

`CTranslate2Translator` translates through the front end `Translator` has (`translation.Engine`).
ctranslate2 is optional (``pip install -e ".[serve]"``), imported only when needed.
"""

import json
import os
import shutil
import uuid

import keras
import numpy as np

from kyu_transformer import filenames
from kyu_transformer.decoding import NO_HYPOTHESIS_SCORE
# Named apart: `length_penalty` is also CTranslate2's own option in this module.
from kyu_transformer.decoding import length_penalty as gnmt_penalty
from kyu_transformer.flags import QUANTIZATIONS
from kyu_transformer.layers import ScaledDotProductAttention, sinusoid_table
from kyu_transformer.search_settings import SearchSettings
from kyu_transformer.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from kyu_transformer.translation import Engine

# Feed-forward activations by Keras name, and CTranslate2's name of each
# (`ctranslate2.specs.Activation`; Keras' gelu is the exact, erf one).
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "silu": "SWISH", "swish": "SWISH"}


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
      hparams: Optional dict of hyperparameters; its ``epsilon`` must be the model's.

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
        for attention in (block.self_attention, getattr(block, "cross_attention", None)):
            if attention is not None:
                problems += _attention_problems(f"{block.name}/{attention.name}", attention,
                                                model.d_model)
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


def _attention_problems(where, attention, d_model):
    """What of one `MultiHeadAttention` (named `where`) CTranslate2 cannot represent."""
    problems = []
    activation = _activation_name(attention.projection_activation)
    if activation != "linear":
        problems.append(f"{where}: `projection_activation={activation!r}`: CTranslate2's "
                        "attention projections are linear")
    widths = {dense.units for dense in (attention.query_dense, attention.key_dense,
                                        attention.value_dense)}
    if widths != {d_model}:
        problems.append(f"{where}: `num_units` (query/key/value widths {sorted(widths)}, not "
                        f"d_model={d_model}): CTranslate2 splits d_model into the heads")
    if not attention.output_projection:
        problems.append(f"{where}: `output_projection=False`: CTranslate2's attention always "
                        "ends with an output projection")
    operator = attention.attention
    if type(operator) is not ScaledDotProductAttention or operator.temperature:
        problems.append(f"{where}: `attention={type(operator).__name__}"
                        f"(temperature={getattr(operator, 'temperature', None)})`: CTranslate2 "
                        "computes softmax(Q K^T / sqrt(d_k)) V only")
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
    _set_weights(spec, model)
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


def _set_weights(spec, model):
    """Fills the encoder and decoder of `spec` with the weights of `model`."""
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
    """Writes `model` as a CTranslate2 model directory, complete or absent.

    CTranslate2's ``model.bin``, ``config.json`` and ``shared_vocabulary.json``, the subword
    model (`filenames.SUBWORDS`: the directory is all a user needs) and what CTranslate2 does not
    keep (`filenames.CTRANSLATE2_SETTINGS`: ``maxlen1``, ``maxlen2``, ...), written beside
    `out_dir` and renamed into place.

    Args:
      model: A built `Transformer` with its trained weights (its float32 variables are written).
      hparams: The dict of hparams.json (``epsilon`` is read from it).
      subwords: The `data.Subwords` the model was trained with.
      out_dir: The directory to write; must not exist or be empty.
      quantization: CTranslate2's weight type, one of `QUANTIZATIONS`.

    Returns:
      `out_dir`.

    Raises:
      ExportError: a setting CTranslate2 cannot represent, an unknown `quantization`, or a
        non-empty `out_dir`.
    """
    check_quantization(quantization)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ExportError(f"{out_dir}: already exists and is not an empty directory")
    spec = build_spec(model, hparams, subwords)
    spec.optimize(quantization=quantization)
    spec.register_file(subwords.path, filenames.SUBWORDS)

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
        path = os.path.join(staging, filenames.CTRANSLATE2_SETTINGS)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(settings, handle, indent=2, sort_keys=True)
            handle.write("\n")
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# ------------------------------------------------------------- translating

def read_settings(model_dir):
    """Our settings written beside a converted model, as a dict."""
    path = os.path.join(model_dir, filenames.CTRANSLATE2_SETTINGS)
    if not os.path.isfile(path):
        raise ExportError(f"{model_dir}: no {filenames.CTRANSLATE2_SETTINGS}; was it written by "
                          "kyu_transformer.ctranslate2_export.convert?")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_vocabulary(model_dir):
    """The pieces of a converted model's shared vocabulary, in id order."""
    path = os.path.join(model_dir, filenames.CTRANSLATE2_VOCABULARY)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _log_softmax(logits):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


class CTranslate2Translator(Engine):
    """A model directory written by `convert`, behind `Translator`'s methods.

    The front end is `translation.Engine`'s. ``translate_batch`` takes one limit a call, so each
    batch is decoded in groups of equal limit (which changes no output). Settings map to options:

    - the limit to ``max_decoding_length`` (EOS counted), ``min_decoding_length=0`` (else no
      output ends before one token), ``max_input_length=0`` (the front end cuts);
    - `beam_size`, `n_best` (``num_hypotheses``) and the sampling settings as they are.
      CTranslate2's random generators belong to its worker threads, seeded by
      ``set_random_seed`` at their first draw: each sampling `translate_ids` sets the seed and
      loads the model anew. The same seed and batches reproduce the samples (sorted here by
      score); other batches do not;
    - greedy search and sampling: ``length_penalty=0`` (the score is the log-probability);
    - beam search: ``length_penalty=alpha``, ``return_end_token=True``. CTranslate2 ranks by
      ``log p / length ** alpha`` where we divide by GNMT's ``((5 + length) / 6) ** alpha``,
      finishes a hypothesis only when EOS is among the `beam_size` best of ``2 * beam_size``
      candidates (ours: among all) and ends a sentence once `beam_size` have finished (ours:
      when no live one can beat the worst finished). Beam outputs may thus differ from ours and
      come in CTranslate2's order (scored as ours); greedy ones do not differ.

    Per-token log-probabilities (`with_log_probs`, greedy only) come from the logits of
    ``return_logits_vocab``, which CTranslate2's beam search does not fill reliably.

    Args:
      model_dir: A directory written by `convert`.
      settings: A `SearchSettings` (default its defaults), with `fields` replaced.
      translator_options: Keyword arguments of ``ctranslate2.Translator`` (such as
        ``intra_threads``); default the CPU. The model is loaded at the first translation.
    """

    log_probs = True

    def __init__(self, model_dir, settings=None, translator_options=None, **fields):
        self._ctranslate2 = _import_ctranslate2()
        ours = read_settings(model_dir)
        super().__init__(ours["maxlen1"], ours["maxlen2"],
                         (settings or SearchSettings()).replace(**fields))
        self.model_dir, self.quantization = model_dir, ours.get("quantization")
        self.translator_options = {"device": "cpu", **(translator_options or {})}
        self.translator = None
        self._pieces = read_vocabulary(model_dir)
        self._ids_of = {piece: i for i, piece in enumerate(self._pieces)}

    def load(self):
        """The ``ctranslate2.Translator`` of the model (loaded at the first call)."""
        if self.translator is None:
            self.translator = self._ctranslate2.Translator(self.model_dir,
                                                           **self.translator_options)
        return self.translator

    def translate_ids(self, source_ids, n_best=None, with_coverage=False, with_log_probs=False,
                      seed=None):
        """`Engine.translate_ids`; sources may also be lists of pieces (strings: those
        outside the vocabulary read as ``<unk>``, as CTranslate2 reads them)."""
        source_ids = [[self._ids_of.get(i, UNK_ID) if isinstance(i, str) else i for i in ids]
                      for ids in source_ids]
        if self.settings.sampling:  # fresh workers, whose generators take the seed
            checked = self.settings.replace(seed=self.settings.seed if seed is None else seed)
            self._ctranslate2.set_random_seed(checked.seed)
            self.translator = None
        return super().translate_ids(source_ids, n_best, with_coverage, with_log_probs, seed)

    def _decode(self, inputs, limits, sentences, n_best, scored, with_coverage, with_log_probs,
                seed):
        settings = self.settings
        sources = [[self._pieces[i] for i in row] for row in inputs.to_list()]
        options = dict(
            beam_size=settings.beam_size, num_hypotheses=n_best,
            length_penalty=settings.alpha if settings.beam_size > 1 else 0.0,
            sampling_topk=settings.sampling_topk, sampling_topp=settings.sampling_topp,
            sampling_temperature=settings.sampling_temperature,
            max_batch_size=settings.batch_size, max_input_length=0, min_decoding_length=0,
            return_end_token=True, return_scores=True, return_logits_vocab=with_log_probs)
        results = [None] * len(sources)
        for limit in sorted(set(limits.tolist())):
            group = [row for row, own in enumerate(limits) if own == limit]
            outputs = self.load().translate_batch(
                [sources[row] for row in group], max_decoding_length=int(limit), **options)
            for row, output in zip(group, outputs):
                results[row] = [self._hypothesis(output, k, with_log_probs)
                                for k in range(min(n_best, len(output.hypotheses)))]
        return self._arrays(results, n_best, int(max(limits)))

    def _hypothesis(self, output, k, with_log_probs):
        """``(ids with EOS if it ended, our score, per-token log-probabilities or None)``."""
        ids = [self._ids_of.get(piece, UNK_ID) for piece in output.hypotheses[k]]
        # CTranslate2's score is the log-probability divided by its own penalty.
        exponent = self.settings.alpha if self.settings.beam_size > 1 else 0.0
        log_prob = output.scores[k] * max(len(ids), 1) ** exponent
        token_log_probs = None
        if with_log_probs:
            token_log_probs = [float(_log_softmax(np.asarray(logits))[token])
                               for logits, token in zip(output.logits[k], ids)]
        return ids, log_prob / float(gnmt_penalty(len(ids), self.settings.alpha)), token_log_probs

    def _arrays(self, results, n_best, width):
        """`_decode`'s ids `(n, K, L)` and scores `(n, K)` (samples sorted by score); a
        hypothesis CTranslate2 did not give is scored as impossible."""
        ids = np.zeros((len(results), n_best, width), "int32")
        scores = np.full((len(results), n_best), NO_HYPOTHESIS_SCORE)
        for row, hypotheses in enumerate(results):
            if not hypotheses:  # none given: an empty output that ended, no score
                ids[row, 0, 0] = EOS_ID
            if self.settings.sampling:
                hypotheses = sorted(hypotheses, key=lambda hypothesis: -hypothesis[1])
            for k, (output, score, _) in enumerate(hypotheses):
                ids[row, k, :len(output)], scores[row, k] = output, score
        log_probs = [hypotheses[0][2] if hypotheses else None for hypotheses in results]
        return {"ids": ids, "scores": scores, "token_log_probs": log_probs}
