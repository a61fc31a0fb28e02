"""Converts a trained `Transformer` to a CTranslate2 model (`convert`) and translates with it.

`convert` fills CTranslate2's `TransformerSpec` with the model's weights and what the spec does
not assume (docs/export.md): our position tables (``maxlen1``/``maxlen2`` rows), embedding scale,
norm position, type and epsilon, tied output layer. A `ScaleNorm` is CTranslate2's RMS norm
with every gain ``g / sqrt(C)`` and epsilon ``epsilon / C`` (the same function); FixNorm's unit
rows are written as the model reads them. The front end appends the source's EOS, not
CTranslate2, whose own cut would keep it and drop a piece. The ctranslate2 package is optional.
"""

import json
import os
import shutil

import keras
import numpy as np

from kyu_transformer import filenames
from kyu_transformer.safety.writes import staging_beside, write_text
from kyu_transformer.decoding.search import NO_HYPOTHESIS_SCORE
# Named apart: `length_penalty` is also CTranslate2's own option in this module.
from kyu_transformer.decoding.scoring import length_penalty as gnmt_penalty
from kyu_transformer.layers import ScaleNorm, sinusoid_table, unit_rows
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, QUANTIZATIONS, UNK_ID
from kyu_transformer.decoding.translator import Engine

# Feed-forward activations by Keras name, and CTranslate2's name of each
# (`ctranslate2.specs.Activation`; Keras' gelu is the exact, erf one).
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "silu": "SWISH", "swish": "SWISH"}


class ExportError(ValueError):
    """Raised for a model or option CTranslate2 cannot take; the message names the setting."""


def _import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise ImportError('The CTranslate2 export needs the ctranslate2 package: '
                          'pip install -e ".[serve]" (or pip install ctranslate2)') from None
    return ctranslate2


def _array(variable):
    """Returns a weight as a float32 numpy array (variables are float32 under mixed precision
    too)."""
    return np.ascontiguousarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)


def _activation_name(function):
    return getattr(function, "__name__", str(function))


def unsupported_settings(model, hparams=None):
    """Returns messages naming what of `model` (built here if not yet) CTranslate2's Transformer
    cannot represent, empty if nothing; `hparams`' ``epsilon``, if given, must be the model's."""
    if not model.built:
        model.build()
    problems = []
    epsilon = model.epsilon if hparams is None else hparams.get("epsilon", model.epsilon)
    if not np.isclose(epsilon, model.epsilon, rtol=1e-6, atol=0):
        problems.append(f"`epsilon` is {epsilon} in hparams but {model.epsilon} in the model")
    for block in model.encoder_blocks + model.decoder_blocks:
        for attention in (block.self_attention, getattr(block, "cross_attention", None)):
            if attention is not None:
                problems += _attention_problems(f"{block.name}/{attention.name}", attention)
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
        if getattr(layer, "rms_scaling", False):
            problems.append(f"{layer.path}: `rms_scaling=True`: CTranslate2's Transformer "
                            "takes layer norms or RMS norms throughout, not a mixture")
    for name in ("source_embedding", "target_embedding"):
        embedding = getattr(model, name)
        if embedding.vocab_size != model.vocab_size or embedding.num_units != model.d_model:
            problems.append(f"{name}: `num_units={embedding.num_units}` / `vocab_size="
                            f"{embedding.vocab_size}` differ from the model's")
    return problems


def _attention_problems(where, attention):
    """Returns what of one `MultiHeadAttention` (named `where`) CTranslate2 cannot represent."""
    problems = []
    activation = _activation_name(attention.projection_activation)
    if activation != "linear":
        problems.append(f"{where}: `projection_activation={activation!r}`: CTranslate2's "
                        "attention projections are linear")
    if not attention.output_projection:
        problems.append(f"{where}: `output_projection=False`: CTranslate2's attention always "
                        "ends with an output projection")
    return problems


def _norm_layers(model):
    layers = [layer.norm for block in model.encoder_blocks + model.decoder_blocks
              for layer in (block.self_attention, block.feed_forward,
                            getattr(block, "cross_attention", None)) if layer is not None]
    if model.norm_position == "pre":
        layers += [model.encoder_norm, model.decoder_norm]
    return layers


def _position_table(positions, width):
    """Returns the `(maxlen, C)` position encodings as the model adds them, for positions 0,
    1, ..."""
    return np.array(sinusoid_table(positions.maxlen, width, positions.style) if positions.sinusoid
                    else _array(positions.position_embeddings), dtype=np.float32)


def _set_linear(spec, *denses):
    """Sets one CTranslate2 linear layer `(out, in)` from one of our `Dense` layers, or several
    side by side (fused Q/K/V)."""
    spec.weight = np.ascontiguousarray(np.concatenate([_array(d.kernel).T for d in denses]))
    if any(d.use_bias for d in denses):
        spec.bias = np.concatenate(
            [_array(d.bias) if d.use_bias else np.zeros(d.units, np.float32) for d in denses])


def _set_layer_norm(spec, layer, width):
    """Sets one CTranslate2 norm from our layer norm, or from a `ScaleNorm` of vectors `width`
    wide (an RMS norm spec: see the module's docstring)."""
    if isinstance(layer, ScaleNorm):
        spec.gamma = np.full(width, _array(layer.gain).item() / np.sqrt(width), np.float32)
        return
    spec.gamma = _array(layer.gamma) if layer.scale else np.ones(width, np.float32)
    spec.beta = _array(layer.beta) if layer.center else np.zeros(width, np.float32)


def _set_attention(spec, attention, self_attention):
    if self_attention:
        _set_linear(spec.linear[0], attention.query_dense, attention.key_dense,
                    attention.value_dense)
    else:
        _set_linear(spec.linear[0], attention.query_dense)
        _set_linear(spec.linear[1], attention.key_dense, attention.value_dense)
    _set_linear(spec.linear[-1], attention.output_dense)
    _set_layer_norm(spec.layer_norm, attention.norm, attention.output_dense.units)


def _set_feed_forward(spec, feed_forward):
    _set_linear(spec.linear_0, feed_forward.inner_dense)
    _set_linear(spec.linear_1, feed_forward.outer_dense)
    _set_layer_norm(spec.layer_norm, feed_forward.norm, feed_forward.num_units[1])


def _set_inputs(spec, embedding, positions, width):
    """Sets the embedding (as the model reads it) and position tables; returns the first."""
    table = _array(embedding.embeddings)
    table[PAD_ID] = 0.0  # as `Embedding.table()` reads it
    if embedding.unit_norm:
        table = keras.ops.convert_to_numpy(unit_rows(table))
    (spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings).weight = table
    spec.scale_embeddings = True  # times sqrt(d_model), as ours
    spec.position_encodings.encodings = _position_table(positions, width)
    return table


def build_spec(model, hparams, subwords):
    """Returns CTranslate2's `TransformerSpec` of `model` and its `subwords`, filled with its
    weights (``epsilon`` from `hparams`) and validated; raises ExportError naming what it cannot
    represent."""
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
        activation=getattr(common_spec.Activation, ACTIVATIONS[activation]),
        rms_norm=model.norm_type == "scale")
    _set_weights(spec, model)
    config = spec.config
    epsilon = float(hparams.get("epsilon", model.epsilon))
    config.layer_norm_epsilon = epsilon / model.d_model if model.norm_type == "scale" else epsilon
    config.unk_token = pieces[UNK_ID]
    config.bos_token = config.decoder_start_token = pieces[BOS_ID]
    config.eos_token = pieces[EOS_ID]
    # EOS is appended to the source by whoever cuts it (see the module's docstring).
    config.add_source_bos = config.add_source_eos = False
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.validate()
    return spec


def _set_weights(spec, model):
    """Fills the encoder and decoder of `spec` with the weights of `model`."""
    encoder, decoder = spec.encoder, spec.decoder
    _set_inputs(encoder, model.source_embedding, model.source_positions, model.d_model)
    # Tied output weights: the logits are the decoder states times the target table.
    decoder.projection.weight = _set_inputs(decoder, model.target_embedding,
                                            model.target_positions, model.d_model)
    for layer_spec, block in zip(encoder.layer + decoder.layer,
                                 model.encoder_blocks + model.decoder_blocks):
        _set_attention(layer_spec.self_attention, block.self_attention, self_attention=True)
        if hasattr(block, "cross_attention"):
            _set_attention(layer_spec.attention, block.cross_attention, self_attention=False)
        _set_feed_forward(layer_spec.ffn, block.feed_forward)
    if model.norm_position == "pre":
        _set_layer_norm(encoder.layer_norm, model.encoder_norm, model.d_model)
        _set_layer_norm(decoder.layer_norm, model.decoder_norm, model.d_model)


def _vocabulary(subwords):
    """Returns the subword model's pieces in id order, after checking its special ids against
    ours (ExportError)."""
    processor = subwords.processor
    expected = {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID}
    for name, value in expected.items():
        if getattr(processor, name)() != value:
            raise ExportError(f"the subword model's `{name}` is {getattr(processor, name)()}, "
                              f"but the model was trained with {value}")
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def convert(model, hparams, subwords, out_dir, quantization="float32"):
    """Writes `model` (as `build_spec`) to `out_dir` (absent or empty), complete or not at all.

    CTranslate2's files, the subword model (`filenames.SUBWORDS`) and what CTranslate2 does not
    keep (`filenames.CTRANSLATE2_SETTINGS`: ``maxlen1``, ...) are written beside `out_dir`, then
    renamed into place; `quantization` is CTranslate2's weight type. Returns `out_dir`.
    """
    if quantization not in QUANTIZATIONS:
        raise ExportError(f"`quantization` must be one of {', '.join(QUANTIZATIONS)} (the weight "
                          f"types of CTranslate2's CPU wheel), got {quantization!r}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ExportError(f"{out_dir}: already exists and is not an empty directory")
    spec = build_spec(model, hparams, subwords)
    spec.optimize(quantization=quantization)
    spec.register_file(subwords.path, filenames.SUBWORDS)

    staging = staging_beside(out_dir, "ctranslate2")
    new = os.path.join(staging, "new")
    try:
        # Mode 0o777 less the umask, as any new folder's (mkdtemp's 0o700 would follow the rename).
        os.mkdir(new)
        spec.save(new)
        settings = {"maxlen1": model.maxlen1, "maxlen2": model.maxlen2,
                    "norm_position": model.norm_position, "norm_type": model.norm_type,
                    "fix_norm": model.fix_norm, "epsilon": model.epsilon,  # the model's
                    "quantization": quantization}
        write_text(os.path.join(new, filenames.CTRANSLATE2_SETTINGS),
                   json.dumps(settings, indent=2, sort_keys=True) + "\n")
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(new, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def device_options(ctranslate2, quantization):
    """Returns the ``ctranslate2.Translator`` options of the device to decode on: CTranslate2's
    first GPU where it sees one, its float parts in float16 where the GPU computes that fast
    (tensor cores; int8 weights stay int8), else the CPU, in the model's own types."""
    if ctranslate2.get_cuda_device_count() == 0:
        return {"device": "cpu"}
    # CTranslate2 lists float16 for a GPU only where it has tensor cores (compute capability 7.0).
    wanted = "float16" if quantization in (None, "float32") else "int8_float16"
    if wanted in ctranslate2.get_supported_compute_types("cuda"):
        return {"device": "cuda", "compute_type": wanted}
    return {"device": "cuda"}  # the model's own types, which CTranslate2 converts where needed


def _log_softmax(logits):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


class CTranslate2Translator(Engine):
    """Translates with a model directory written by `convert`, behind the front end of
    `Translator` (`decoding.translator.Engine`), with `settings` (default `SearchSettings()`) and
    `fields` replaced.

    Each batch is decoded in groups of equal limit (``max_decoding_length``: CTranslate2 takes
    one a call). Beam outputs may differ from ours (CTranslate2's length penalty and stop rule,
    docs/export.md) and come in its order, scored as ours; greedy ones do not differ. Sampling
    reloads the model after setting the seed (its worker threads seed their generators at
    their first draw): the same seed and batches repeat the samples, sorted here by score.
    `translator_options` go to ``ctranslate2.Translator``; without a ``device`` among them,
    `device_options` chooses it.
    """

    log_probs = True

    def __init__(self, model_dir, settings=None, translator_options=None, **fields):
        self._ctranslate2 = _import_ctranslate2()
        path = os.path.join(model_dir, filenames.CTRANSLATE2_SETTINGS)  # what `convert` adds
        if not os.path.isfile(path):
            raise ExportError(f"{model_dir}: no {filenames.CTRANSLATE2_SETTINGS}; was it written "
                              "by kyu_transformer.export.ctranslate2.convert?")
        with open(path, encoding="utf-8") as handle:
            ours = json.load(handle)
        super().__init__(ours["maxlen1"], ours["maxlen2"], settings, **fields)
        self.model_dir, self.quantization = model_dir, ours.get("quantization")
        given = translator_options or {}  # a device given takes CTranslate2's defaults on it
        self.translator_options = {**({} if "device" in given else device_options(
            self._ctranslate2, self.quantization)), **given}
        self.translator = None
        with open(os.path.join(model_dir, filenames.CTRANSLATE2_VOCABULARY),
                  encoding="utf-8") as handle:
            self._pieces = json.load(handle)  # in id order
        self._ids_of = {piece: i for i, piece in enumerate(self._pieces)}

    def replaced(self, **fields):
        """Returns this engine with its settings' `fields` replaced, sharing the loaded model."""
        engine = CTranslate2Translator(self.model_dir, self.settings.replace(**fields),
                                       self.translator_options)
        engine.translator = self.translator
        return engine

    def load(self):
        """Returns the ``ctranslate2.Translator`` of the model, loaded at the first call."""
        if self.translator is None:
            self.translator = self._ctranslate2.Translator(self.model_dir,
                                                           **self.translator_options)
        return self.translator

    def translate_ids(self, source_ids, n_best=None, with_coverage=False, with_log_probs=False,
                      seed=None, prefix_ids=None):
        """Translates as `Engine.translate_ids` does; sources may also be lists of pieces
        (strings: those outside the vocabulary read as ``<unk>``, as CTranslate2 reads them)."""
        source_ids = [[self._ids_of.get(i, UNK_ID) if isinstance(i, str) else i for i in ids]
                      for ids in source_ids]
        if self.settings.sampling:  # fresh workers, whose generators take the seed
            checked = self.settings.replace(seed=self.settings.seed if seed is None else seed)
            self._ctranslate2.set_random_seed(checked.seed)
            self.translator = None
        return super().translate_ids(source_ids, n_best, with_coverage, with_log_probs, seed,
                                     prefix_ids)

    def _decode(self, inputs, limits, sentences, prefixes, request):
        """Decodes one batch into ids `(n, K, L)` and scores `(n, K)` (samples sorted by score;
        a hypothesis CTranslate2 did not give is scored as impossible), and the first
        hypotheses' log-probabilities; `prefixes` go to CTranslate2's `target_prefix`."""
        settings = self.settings
        n_best, with_log_probs = request.n_best, request.with_log_probs
        sources = [[self._pieces[i] for i in row] for row in inputs.to_list()]
        prefix_log_probs = np.zeros(len(sources))
        if prefixes is not None:
            if with_log_probs:
                raise ValueError("`with_log_probs` with prefixes is not given by "
                                 f"{type(self).__name__}")
            prefixes = [[self._pieces[i] for i in row] for row in prefixes]
            prefix_log_probs = self._prefix_log_probs(sources, prefixes)
        penalty = settings.alpha if settings.beam_size > 1 else 0.0
        # No minimum length (else no output ends before one token), no cut (the front end's);
        # `return_logits_vocab` gives the log-probabilities (greedy only: beams fill it unreliably).
        options = dict(
            beam_size=settings.beam_size, num_hypotheses=n_best, length_penalty=penalty,
            sampling_topk=settings.sampling_topk, sampling_topp=settings.sampling_topp,
            sampling_temperature=settings.sampling_temperature,
            max_batch_size=settings.batch_size, max_input_length=0, min_decoding_length=0,
            return_end_token=True, return_scores=True, return_logits_vocab=with_log_probs)
        ids = np.zeros((len(sources), n_best, int(max(limits))), "int32")
        scores = np.full((len(sources), n_best), NO_HYPOTHESIS_SCORE)
        log_probs = [None] * len(sources)
        for limit in sorted(set(limits.tolist())):
            group = [row for row, own in enumerate(limits) if own == limit]
            outputs = self.load().translate_batch(
                [sources[row] for row in group], max_decoding_length=int(limit),
                target_prefix=None if prefixes is None else [prefixes[row] for row in group],
                **options)
            for row, output in zip(group, outputs):
                hypotheses = [self._hypothesis(output, k, penalty, with_log_probs,
                                               prefix_log_probs[row])
                              for k in range(min(n_best, len(output.hypotheses)))]
                if not hypotheses:  # none given: an empty output that ended, no score
                    ids[row, 0, 0] = EOS_ID
                else:
                    log_probs[row] = hypotheses[0][2]
                if settings.sampling:
                    hypotheses.sort(key=lambda hypothesis: -hypothesis[1])
                for k, (hypothesis, score, _) in enumerate(hypotheses):
                    ids[row, k, :len(hypothesis)], scores[row, k] = hypothesis, score
        return {"ids": ids, "scores": scores, "token_log_probs": log_probs}

    def _prefix_log_probs(self, sources, prefixes):
        """Returns the log-probability `(n,)` of each prefix of piece lists `prefixes` (0 for
        none) given its source, by CTranslate2's forced decoding (``score_batch``)."""
        rows = [row for row, prefix in enumerate(prefixes) if prefix]
        found = np.zeros(len(prefixes))
        if rows:
            scored = self.load().score_batch([sources[row] for row in rows],
                                             [prefixes[row] for row in rows], max_input_length=0)
            for row, result in zip(rows, scored):  # the last log-probability is EOS's
                found[row] = sum(result.log_probs[:len(prefixes[row])])
        return found

    def _hypothesis(self, output, k, penalty, with_log_probs, prefix_log_prob=0.0):
        """Returns hypothesis `k` of `output` as ``(ids with EOS if it ended, our score,
        per-token log-probabilities or None)``; `penalty` is the exponent of CTranslate2's
        length penalty, `prefix_log_prob` that of the hypothesis' prefix."""
        ids = [self._ids_of.get(piece, UNK_ID) for piece in output.hypotheses[k]]
        # CTranslate2's score is the log-probability of the tokens after the prefix, divided by
        # its own penalty of the whole hypothesis' length.
        log_prob = output.scores[k] * max(len(ids), 1) ** penalty + prefix_log_prob
        token_log_probs = None
        if with_log_probs:
            token_log_probs = [float(_log_softmax(np.asarray(logits))[token])
                               for logits, token in zip(output.logits[k], ids)]
        return ids, log_prob / float(gnmt_penalty(len(ids), self.settings.alpha)), token_log_probs
