"""The CTranslate2 export: CTranslate2's translations against ours, and what is refused."""

import collections
import json
import os
import stat

import keras
import numpy as np
import pytest
import tensorflow as tf

ctranslate2 = pytest.importorskip("ctranslate2")

from kyu_transformer import filenames  # noqa: E402
from kyu_transformer.conventions import QUANTIZATIONS  # noqa: E402
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: E402
from kyu_transformer.data.subwords import Subwords  # noqa: E402
from kyu_transformer.data.text import load_split  # noqa: E402
from kyu_transformer.decoding.scoring import sequence_log_probs  # noqa: E402
from kyu_transformer.decoding.search import output_limit  # noqa: E402
from kyu_transformer.decoding.translator import Translator  # noqa: E402
from kyu_transformer.export.ctranslate2 import (  # noqa: E402
    CTranslate2Translator, ExportError, convert, device_options)
from kyu_transformer.model import Transformer  # noqa: E402
from tests.conftest import copy_of_logdir, load_logdir  # noqa: E402
from tests.programs import run  # noqa: E402
from tests.test_data import MULTI30K  # noqa: E402

# Characters that no Multi30k sentence holds: the subword model maps them to <unk>.
UNKNOWN_TEXT = ["Ein Mann ☃ spielt 𝄞 Gitarre.", "Zwei Hunde ✈ im Schnee ¤."]


def _load(logdir):
    hparams, model, subwords = load_logdir(logdir)
    return {"model": model, "hparams": hparams, "subwords": subwords}


def _source_ids(subwords, maxlen1):
    """The 300 val sources, 6 longer than maxlen1, 2 with unknown characters, an empty one."""
    val, _, _ = load_split(MULTI30K, "val")
    texts = val + [" ".join(val[first:first + 5]) for first in range(0, 30, 5)]
    texts += UNKNOWN_TEXT + [""]
    ids = subwords.encode(texts)
    assert sum(len(source) + 1 > maxlen1 for source in ids) >= 6  # some are cut
    assert all(UNK_ID in source for source in ids[-3:-1])
    return ids


class Hypothesis(collections.namedtuple("Hypothesis", "ids score log_prob log_probs truncated")):
    """The `k`-th hypothesis of each sentence of CTranslate2's `Translations`, with its
    log-probability (the score times GNMT's penalty, EOS counted) and its token log-probs."""


def _hypotheses(translations, alpha=0.6):
    """Per sentence, its `Hypothesis` list."""
    results = []
    for index, (outputs, scores, ended) in enumerate(zip(
            translations.hypotheses, translations.scores or [[0.0]] * len(translations.ended),
            translations.ended)):
        log_probs = translations.token_log_probs
        results.append([Hypothesis(ids, score, score * ((5 + len(ids) + end) / 6) ** alpha,
                                   log_probs[index] if log_probs else None, not end)
                        for ids, score, end in zip(outputs, scores, ended)])
    return results


def ctranslate2_translations(model_dir, sources, n_best=None, **settings):
    """Per source, CTranslate2's `Hypothesis` list (with log-probabilities when greedy)."""
    engine = CTranslate2Translator(model_dir, **settings)
    greedy = engine.settings.beam_size == 1 and not engine.settings.sampling
    return _hypotheses(engine.translate_ids(sources, n_best=n_best or 1,
                                            with_log_probs=greedy and not n_best),
                       engine.settings.alpha)


def _greedy_of_both(model, exported, sources):
    """Our greedy outputs (and the Translator's count) and CTranslate2's, with log-probabilities."""
    found = Translator(model, beam_size=1).translate_ids(sources)
    theirs = ctranslate2_translations(exported, sources, beam_size=1)
    return {"ours": found.outputs, "theirs": [hypotheses[0] for hypotheses in theirs],
            "truncated_outputs": found.truncated_outputs}


@pytest.fixture(scope="module")
def varied(varied_tiny_logdir):
    """The session's model with set weights (outputs that vary and run long)."""
    return _load(varied_tiny_logdir)  # only read here


@pytest.fixture(scope="module")
def exported(varied, tmp_path_factory):
    """The varied model converted with float32 weights."""
    out_dir = str(tmp_path_factory.mktemp("exported") / "float32")
    return convert(varied["model"], varied["hparams"], varied["subwords"], out_dir)


@pytest.fixture(scope="module")
def sources(varied):
    return _source_ids(varied["subwords"], varied["model"].maxlen1)


@pytest.fixture(scope="module")
def greedy_results(varied, exported, sources):
    return _greedy_of_both(varied["model"], exported, sources)


@pytest.fixture(scope="module")
def trained(trained_tiny_logdir, tmp_path_factory):
    """The session's trained model, its conversion, sources and both engines' greedy outputs.

    For the comparisons whose figures a learned model sets: its peaked
    distributions keep float32 rounding within 2e-5 in log-probability (seen: 1.3e-5) and
    most argmaxes out of the reach of int8 weights' rounding.
    """
    loaded = _load(trained_tiny_logdir)  # only read here
    exported = convert(loaded["model"], loaded["hparams"], loaded["subwords"],
                       str(tmp_path_factory.mktemp("trained-exported") / "float32"))
    sources = _source_ids(loaded["subwords"], loaded["model"].maxlen1)
    return {**loaded, "exported": exported, "sources": sources,
            **_greedy_of_both(loaded["model"], exported, sources)}


@pytest.fixture(scope="module")
def subwords(tmp_path_factory):
    """A 400-piece subword model of the test corpus, for untrained models."""
    sources, targets, _ = load_split(MULTI30K, "train")
    return Subwords.train_or_load(str(tmp_path_factory.mktemp("subwords")),
                                  sources + targets, 400)


@pytest.fixture(scope="module")
def random_model(subwords):
    """An untrained model of the subword model's vocabulary, for the tests that only read it."""
    return _random_model(subwords.vocab_size)


@pytest.fixture(scope="module")
def random_export(random_model, subwords, tmp_path_factory):
    """`random_model` converted, for the tests that only read the conversion."""
    return convert(random_model, {"epsilon": 1e-6}, subwords,
                   str(tmp_path_factory.mktemp("random") / "model"))


def _random_model(vocab_size, norm_position="post", epsilon=1e-6, **kwargs):
    model = Transformer(vocab_size, d_model=32, d_ff=64, num_blocks=2, num_heads=4, maxlen1=24,
                        maxlen2=28, dropout_rate=0.0, norm_position=norm_position,
                        epsilon=epsilon, **kwargs)
    model.build()
    return model


def _encoder_inputs(model, sources):
    """Source ids with EOS, cut to maxlen1, as `Translator` feeds the encoder."""
    return [(list(source) + [EOS_ID])[:model.maxlen1] for source in sources]


def _padded(sequences):
    width = max(len(sequence) for sequence in sequences)
    return np.array([list(s) + [PAD_ID] * (width - len(s)) for s in sequences], "int32")


def _full_outputs(hypotheses):
    """Each output's generated ids: EOS included unless it was cut at its limit."""
    return [h.ids + ([] if h.truncated else [EOS_ID]) for h in hypotheses]


def _our_token_log_probs(model, sources, outputs, batch_size=64):
    """Our model's log-probability of each token of each output (EOS included)."""
    results = []
    for first in range(0, len(sources), batch_size):
        source = _padded(_encoder_inputs(model, sources[first:first + batch_size]))
        batch = outputs[first:first + batch_size]
        target_in = _padded([[BOS_ID] + output[:-1] for output in batch])
        logits = keras.ops.convert_to_numpy(
            model({"source": source, "target_in": target_in}, training=False)).astype("float64")
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        for row, output in enumerate(batch):
            results.append(log_probs[row, np.arange(len(output)), output])
    return results


def _our_log_probs(model, sources, outputs):
    """`sequence_log_probs` of each output (EOS included), one sentence at a time (in one
    traced graph: eager, each of hundreds of calls would run the model op by op)."""
    spec = tf.TensorSpec((None, None), tf.int32)
    log_probs = tf.function(lambda source, output: sequence_log_probs(model, source, output),
                            input_signature=[spec, spec], autograph=False)
    return [float(log_probs(_padded([source]), _padded([output]))[0])
            for source, output in zip(_encoder_inputs(model, sources), outputs)]


# ------------------------------------------- the models of the logdirs (set, trained)

@pytest.mark.slow
@pytest.mark.cpu_exact
def test_greedy_outputs_equal_ours_token_for_token(varied, sources, greedy_results):
    """CTranslate2's greedy outputs are ours, cut at the same limits.

    Assumes a CPU: CTranslate2 decodes on the CPU and our model on the GPU where one is seen,
    whose kernels round otherwise and may tip a near-tie between two tokens."""
    ours, theirs = greedy_results["ours"], greedy_results["theirs"]
    assert [h.ids for h in theirs] == ours
    assert len({tuple(output) for output in ours}) >= 10  # a model that says different things
    # Outputs cut at their own limit without EOS are cut at the same place.
    truncated = sum(h.truncated for h in theirs)
    assert truncated == greedy_results["truncated_outputs"] > 0
    assert theirs[-1].ids == ours[-1] == []  # the empty source


@pytest.mark.slow
def test_per_token_log_probs_equal_ours(trained):
    model, sources, theirs = trained["model"], trained["sources"], trained["theirs"]
    decoded = [i for i, source in enumerate(sources) if source]
    outputs = _full_outputs([theirs[i] for i in decoded])
    ours = _our_token_log_probs(model, [sources[i] for i in decoded], outputs)
    largest = max(float(np.max(np.abs(mine - np.array(theirs[i].log_probs))))
                  for mine, i in zip(ours, decoded))
    print(f"largest per-token log-probability difference: {largest:.2e}")
    assert largest < 2e-5
    # Sentence log-probabilities: CTranslate2 sums in float32 as it decodes.
    sums = _our_log_probs(model, [sources[i] for i in decoded], outputs)
    np.testing.assert_allclose([theirs[i].log_prob for i in decoded], sums, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_prefixed_outputs_equal_ours_and_score_their_prefix(trained):
    """With target prefixes (CTranslate2's `target_prefix`): greedy outputs and scores equal
    `Translator`'s, and every hypothesis (beam's n-best too) starts with its prefix and scores
    as forced decoding of the whole output (the prefix's log-probability counted).

    Assumes a CPU, as the greedy comparison above."""
    model, sources = trained["model"], trained["sources"][:120]
    prefixes = [output[:row % 4] for row, output in enumerate(trained["ours"][:120])]
    prefixes[5] = [20, 21, 22]  # subwords the model would not choose
    engine = CTranslate2Translator(trained["exported"], beam_size=1)
    theirs = engine.translate_ids(sources, n_best=1, prefix_ids=prefixes)
    ours = Translator(model, beam_size=1).translate_ids(sources, n_best=1, prefix_ids=prefixes)
    assert theirs.hypotheses == ours.hypotheses
    np.testing.assert_allclose(theirs.scores, ours.scores, rtol=1e-5, atol=1e-5)
    beams = engine.replaced(beam_size=4, alpha=0.6).translate_ids(sources, n_best=2,
                                                                  prefix_ids=prefixes)
    ended = [(row, j) for row, flags in enumerate(beams.ended) for j, flag in enumerate(flags)
             if flag]
    assert len(ended) > 150
    for row, j in ended:
        assert beams.hypotheses[row][j][:len(prefixes[row])] == prefixes[row]
    forced, _ = Translator(model, alpha=0.6).score_ids(
        [sources[row] for row, _ in ended], [beams.hypotheses[row][j] for row, j in ended])
    np.testing.assert_allclose([beams.scores[row][j] for row, j in ended],
                               [result.score for result in forced], rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_an_empty_source_has_one_empty_hypothesis_as_in_translator(varied, exported,
                                                                   sources):
    theirs = ctranslate2_translations(exported, [[]] + sources[:3], beam_size=3, n_best=2)
    found = Translator(varied["model"], beam_size=3).translate_ids([[]] + sources[:3], n_best=2)
    hypotheses, scores = found.hypotheses, found.scores
    assert [(h.ids, h.score) for h in theirs[0]] == list(zip(hypotheses[0], scores[0])) == \
        [([], 0.0)]
    assert all(len(row) == 2 for row in theirs[1:])


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_pieces_and_unknown_characters_translate_as_ids(varied, exported, sources,
                                                        greedy_results):
    """Pieces outside the vocabulary (unknown characters) are <unk> to CTranslate2 too.

    Assumes a CPU: CTranslate2 decodes on the CPU and our model on the GPU where one is seen,
    whose kernels round otherwise and may tip a near-tie between two tokens."""
    processor = varied["subwords"].processor
    pieces = [[processor.id_to_piece(i) for i in source] for source in sources[:-3]]
    pieces += processor.encode(UNKNOWN_TEXT, out_type=str) + [[]]
    vocabulary = {processor.id_to_piece(i) for i in range(processor.get_piece_size())}
    assert all(set(source) - vocabulary for source in pieces[-3:-1])
    theirs = ctranslate2_translations(exported, pieces, beam_size=1)
    assert [hypotheses[0].ids for hypotheses in theirs] == greedy_results["ours"]


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_each_sentence_keeps_its_own_limit(varied, exported, sources):
    """A tighter limit than maxlen2 and a small margin: many outputs end at their limit.

    Assumes a CPU: CTranslate2 decodes on the CPU and our model on the GPU where one is seen,
    whose kernels round otherwise and may tip a near-tie between two tokens."""
    model, chosen = varied["model"], sources[:120]
    found = Translator(model, beam_size=1, max_length=20, length_margin=2).translate_ids(chosen)
    engine = CTranslate2Translator(exported, beam_size=1, max_length=20, length_margin=2)
    theirs_found = engine.translate_ids(chosen)
    theirs = _hypotheses(theirs_found)
    assert [hypotheses[0].ids for hypotheses in theirs] == found.outputs
    assert sum(hypotheses[0].truncated for hypotheses in theirs) == \
        theirs_found.truncated_outputs == found.truncated_outputs >= 10
    assert theirs_found.truncated_sources == found.truncated_sources
    for source, hypotheses in zip(chosen, theirs):
        length = len(hypotheses[0].ids) + (not hypotheses[0].truncated)
        assert length <= output_limit(len(source), model.maxlen1, 20, 2)


@pytest.mark.slow
def test_beam_search_scores_are_log_probabilities_over_gnmt_penalties(varied, exported,
                                                                      sources):
    model, chosen, alpha = varied["model"], sources[:60], 0.6
    theirs = ctranslate2_translations(exported, chosen, beam_size=4, alpha=alpha, n_best=2)
    hypotheses = [h for per_sentence in theirs for h in per_sentence]
    repeated = [source for source in chosen for _ in range(2)]
    outputs = _full_outputs(hypotheses)
    np.testing.assert_allclose([h.log_prob for h in hypotheses],
                               _our_log_probs(model, repeated, outputs), rtol=1e-5, atol=1e-4)
    for h, output in zip(hypotheses, outputs):
        assert h.score == pytest.approx(h.log_prob / ((5 + len(output)) / 6) ** alpha)
    for source, (best, second) in zip(chosen, theirs):
        assert best.ids != second.ids
        # CTranslate2's own order: log-probability over length ** alpha, EOS counted.
        assert (best.log_prob / (len(best.ids) + (not best.truncated)) ** alpha
                >= second.log_prob / (len(second.ids) + (not second.truncated)) ** alpha - 1e-6)
        limit = output_limit(len(source), model.maxlen1, model.maxlen2, 16)
        assert len(best.ids) + (not best.truncated) <= limit


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int8_float32"])
def test_quantized_models_write_and_translate(trained, tmp_path, quantization):
    out_dir = convert(trained["model"], trained["hparams"], trained["subwords"],
                      str(tmp_path / quantization), quantization=quantization)
    translator = ctranslate2.Translator(out_dir)
    assert translator.compute_type == "int8_float32"  # int8 weights, float32 elsewhere
    assert os.path.getsize(os.path.join(out_dir, "model.bin")) < \
        0.5 * os.path.getsize(os.path.join(trained["exported"], "model.bin"))
    model, sources = trained["model"], trained["sources"]
    # Computed in int8: a translation of every source within its limit. How many differ from
    # ours depends on the processor and the model: without VNNI, CTranslate2's oneDNN kernels
    # add pairs of int8 products in 16 bits, which saturate (RESULTS.md, "Test suite").
    in_int8 = ctranslate2_translations(out_dir, sources, beam_size=1)
    assert len(in_int8) == len(sources)
    for source, hypotheses in zip(sources, in_int8):
        length = len(hypotheses[0].ids) + (not hypotheses[0].truncated)
        assert length <= output_limit(len(source), model.maxlen1, model.maxlen2, 16)
    # The weights as written, computed in float32: only their rounding separates the outputs.
    theirs = ctranslate2_translations(out_dir, sources, beam_size=1,
                                      translator_options={"compute_type": "float32"})
    same = sum(hypotheses[0].ids == output
               for hypotheses, output in zip(theirs, trained["ours"]))
    assert same >= 0.5 * len(sources)  # rounded weights change some outputs, not most


# -------------------------------------------------------- untrained models

@pytest.mark.parametrize("norm_position, share_embeddings, sinusoid, norm_type, fix_norm", [
    ("pre", True, True, "layer", False), ("pre", False, False, "layer", False),
    ("post", False, False, "layer", False), ("pre", True, True, "scale", True),
    ("post", False, True, "scale", False)])
@pytest.mark.cpu_exact
def test_untrained_models_convert_exactly(subwords, tmp_path, norm_position, share_embeddings,
                                          sinusoid, norm_type, fix_norm):
    """Pre-norm, a source table apart, learned positions, ScaleNorm (each gain its own) and
    FixNorm; an epsilon far from CTranslate2's.

    With epsilon 1e-2, a conversion that left CTranslate2's default epsilon
    in place would be off by about 1e-3 in log-probability.
    Assumes a CPU: CTranslate2 decodes on the CPU and our model on the GPU where one is seen,
    whose kernels round otherwise and may tip a near-tie between two tokens.
    """
    model = _random_model(subwords.vocab_size, norm_position, share_embeddings=share_embeddings,
                          sinusoid=sinusoid, epsilon=1e-2, norm_type=norm_type,
                          fix_norm=fix_norm)
    gains = [weight for weight in model.weights if weight.path.endswith("/gain")]
    assert len(gains) == (norm_type == "scale") * (5 * 2 + 2 * (norm_position == "pre"))
    for gain, value in zip(gains, np.random.default_rng(5).uniform(2.0, 8.0, len(gains))):
        gain.assign(value)
    out_dir = convert(model, {"epsilon": 1e-2}, subwords, str(tmp_path / "model"))
    val, _, _ = load_split(MULTI30K, "val")
    sources = subwords.encode(val[:80])
    ours = Translator(model, beam_size=1, length_margin=4).translate_ids(sources).outputs
    theirs = [h[0] for h in ctranslate2_translations(out_dir, sources, beam_size=1,
                                                     length_margin=4)]
    assert [h.ids for h in theirs] == ours
    with open(os.path.join(out_dir, filenames.CTRANSLATE2_SETTINGS), encoding="utf-8") as handle:
        settings = json.load(handle)
    assert (settings["norm_type"], settings["fix_norm"], settings["epsilon"]) == (
        norm_type, fix_norm, 1e-2)  # the model's, whatever CTranslate2's config holds
    mine = _our_token_log_probs(model, sources, _full_outputs(theirs))
    assert max(float(np.max(np.abs(m - np.array(h.log_probs))))
               for m, h in zip(mine, theirs)) < 1e-5


def test_model_directory_holds_what_a_user_needs(random_model, subwords, tmp_path):
    model = random_model
    out_dir = convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "model"))
    assert sorted(os.listdir(out_dir)) == sorted(
        ["model.bin", "config.json", "shared_vocabulary.json", filenames.SUBWORDS,
         filenames.CTRANSLATE2_SETTINGS])
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    assert (config["unk_token"], config["bos_token"], config["eos_token"],
            config["decoder_start_token"]) == ("<unk>", "<s>", "</s>", "<s>")
    assert config["layer_norm_epsilon"] == pytest.approx(1e-6)
    assert config["add_source_eos"] is False  # appended by the caller, before cutting
    with open(os.path.join(out_dir, "shared_vocabulary.json"), encoding="utf-8") as handle:
        pieces = json.load(handle)
    assert pieces == [subwords.processor.id_to_piece(i) for i in range(subwords.vocab_size)]
    assert pieces[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    with open(os.path.join(out_dir, filenames.CTRANSLATE2_SETTINGS), encoding="utf-8") as handle:
        assert json.load(handle)["maxlen1"] == model.maxlen1
    with open(os.path.join(out_dir, filenames.SUBWORDS), "rb") as copy, \
            open(subwords.path, "rb") as original:
        assert copy.read() == original.read()
    assert [name for name in os.listdir(tmp_path) if name != "model"] == []  # no staging left


def test_the_model_folder_takes_the_umask_without_changing_it(random_model, subwords, tmp_path,
                                                              monkeypatch):
    """Mode 0o777 less the umask, as any new folder's; the process umask is never set (a file
    another thread made meanwhile would be world-writable)."""
    model = random_model
    set_umask, calls = os.umask, []
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or set_umask(mask))
    previous = set_umask(0o027)
    try:
        out_dir = convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "model"))
    finally:
        set_umask(previous)
    assert calls == []
    assert stat.S_IMODE(os.stat(out_dir).st_mode) == 0o750


def test_mixed_precision_models_write_their_float32_weights(random_model, subwords, tmp_path):
    model = random_model
    convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "float32"))
    keras.config.set_dtype_policy("mixed_bfloat16")
    mixed = _random_model(subwords.vocab_size)
    mixed.set_weights(model.get_weights())
    convert(mixed, {"epsilon": 1e-6}, subwords, str(tmp_path / "mixed"))
    with open(tmp_path / "float32" / "model.bin", "rb") as first, \
            open(tmp_path / "mixed" / "model.bin", "rb") as second:
        assert first.read() == second.read()


def _relu_projections(model):
    # The Transformer has no option for it: a model made of the layers with
    # the original's `projection_activation="relu"` has it on its attention.
    model.decoder_blocks[1].cross_attention.projection_activation = keras.activations.relu


def _tanh_feed_forward(model):
    model.encoder_blocks[0].feed_forward.activation = keras.activations.tanh


@pytest.mark.parametrize("change, hparams, expected", [
    (_relu_projections, {}, "projection_activation='relu'"),
    (_tanh_feed_forward, {}, "activation='tanh'"),
    (None, {"epsilon": 1e-8}, "`epsilon` is 1e-08 in hparams but 1e-06 in the model"),
])
def test_unrepresentable_models_are_refused_naming_the_setting(subwords, tmp_path, change,
                                                               hparams, expected):
    model = _random_model(subwords.vocab_size, epsilon=1e-6)
    if change is not None:
        change(model)
    with pytest.raises(ExportError, match="CTranslate2 cannot represent") as error:
        convert(model, {"epsilon": 1e-6, **hparams}, subwords, str(tmp_path / "model"))
    assert expected in str(error.value)
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_vocabulary_of_another_size_is_refused(subwords, tmp_path):
    model = _random_model(subwords.vocab_size - 1)
    with pytest.raises(ExportError, match="`vocab_size`: the model has 399 ids but the subword "
                                          "model 400 pieces"):
        convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "model"))


@pytest.mark.parametrize("quantization", ["float16", "bfloat16", "int16", "int8_float16",
                                          "fp32", None])
def test_other_quantizations_are_refused_naming_the_accepted_ones(random_model, subwords,
                                                                  tmp_path, quantization):
    model = random_model
    with pytest.raises(ExportError) as error:
        convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "model"),
                quantization=quantization)
    assert f"`quantization` must be one of {', '.join(QUANTIZATIONS)}" in str(error.value)
    assert repr(quantization) in str(error.value)
    assert os.listdir(tmp_path) == []


def test_a_non_empty_directory_is_refused_an_empty_one_filled(random_model, subwords, tmp_path):
    model = random_model
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists and is not an empty directory"):
        convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "full"))
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "empty"))
    assert "model.bin" in os.listdir(tmp_path / "empty")


@pytest.mark.parametrize("options, request_, message", [
    (dict(beam_size=2), dict(n_best=3), "`n_best` (3) must be at most `beam_size` (2)"),
    (dict(sampling_topk=0), dict(seed=2**32 - 1), "`seed` must be below 4294967295"),
    (dict(beam_size=4), dict(with_log_probs=True), "`with_log_probs` needs greedy search"),
    (dict(beam_size=1), dict(with_coverage=True),
     "`with_coverage` is not given by CTranslate2Translator"),
    (dict(max_length=29), {}, "`max_length` must be in [1, 28]"),
    (dict(length_margin=-1), {}, "`length_margin` must be at least 0"),
    (dict(beam_size=0), {}, "`beam_size` must be at least 1"),
])
def test_impossible_translation_options_are_refused(random_export, options, request_, message):
    with pytest.raises(ValueError) as error:
        CTranslate2Translator(random_export, **options).translate_ids([[5, 6, 7]], **request_)
    assert message in str(error.value)


def _eos_first(model):
    """`model` changed so that EOS is the most likely token at every position.

    Post-norm: the last block ends with its feed-forward's norm, whose output
    becomes its bias alone (scale 0); that bias is EOS's (enlarged) embedding,
    so the tied output layer's logit of EOS is the largest.
    """
    rows = np.array(model.target_embedding.embeddings.numpy())
    rows[EOS_ID] *= 10.0
    model.target_embedding.embeddings.assign(rows)
    norm = model.decoder_blocks[-1].feed_forward.norm
    norm.gamma.assign(np.zeros_like(norm.gamma.numpy()))
    norm.beta.assign(rows[EOS_ID])
    return model


@pytest.mark.parametrize("beam_size", [1, 4])
def test_an_output_that_ends_at_once_is_empty_in_both(subwords, tmp_path, beam_size):
    """CTranslate2 would give at least one token without ``min_decoding_length=0``."""
    model = _eos_first(_random_model(subwords.vocab_size))
    out_dir = convert(model, {"epsilon": 1e-6}, subwords, str(tmp_path / "model"))
    val, _, _ = load_split(MULTI30K, "val")
    sources = subwords.encode(val[:20])
    ours = Translator(model, beam_size=beam_size).translate_ids(sources).outputs
    theirs = ctranslate2_translations(out_dir, sources, beam_size=beam_size)
    assert ours == [[]] * len(sources)
    assert [hypotheses[0].ids for hypotheses in theirs] == ours
    assert not any(hypotheses[0].truncated for hypotheses in theirs)  # they ended with EOS


@pytest.mark.slow
@pytest.mark.cpu_exact
def test_sampling_repeats_with_its_seed_and_top_k_one_is_greedy(varied, exported, sources,
                                                                greedy_results):
    """CTranslate2's generators are its worker threads': a seed set before a fresh load,
    with the same batches, repeats the samples.

    Assumes a CPU: CTranslate2 decodes on the CPU and our model on the GPU where one is seen,
    whose kernels round otherwise and may tip a near-tie between two tokens."""
    engine = CTranslate2Translator(exported, sampling_topk=5, sampling_topp=0.9)
    first = engine.translate_ids(sources, n_best=3, seed=4)
    assert engine.translate_ids(sources, n_best=3, seed=4) == first
    other = engine.translate_ids(sources, n_best=3, seed=5)
    decoded = [i for i, source in enumerate(sources) if source]
    assert sum(first.hypotheses[i] != other.hypotheses[i] for i in decoded) >= 0.5 * len(decoded)
    assert all(len(first.scores[i]) == 3 and first.scores[i] == sorted(first.scores[i],
                                                                       reverse=True)
               for i in decoded)
    assert sum(len({tuple(h) for h in first.hypotheses[i]}) > 1 for i in decoded) >= \
        0.8 * len(decoded)
    # Each sample scored as ours: the model's log-probability over GNMT's penalty.
    chosen = [(i, k) for i in decoded[:40] for k in range(3) if first.ended[i][k]]
    outputs = [first.hypotheses[i][k] + [EOS_ID] for i, k in chosen]
    log_probs = _our_log_probs(varied["model"], [sources[i] for i, _ in chosen], outputs)
    np.testing.assert_allclose([first.scores[i][k] for i, k in chosen],
                               [lp / ((5 + len(o)) / 6) ** 0.6
                                for lp, o in zip(log_probs, outputs)],
                               rtol=1e-4, atol=1e-4)
    greedy = CTranslate2Translator(exported, sampling_topk=1, beam_size=1).translate_ids(
        sources, seed=4)
    assert greedy.outputs == greedy_results["ours"]


# ------------------------------------------------------------------ the device

# What CTranslate2 lists for the GPU of each compute capability (tensor cores from 7.0).
TENSOR_CORES = {"float32", "int8", "int8_float32", "int8_float16", "float16"}
NO_TENSOR_CORES = {"float32", "int8", "int8_float32"}


@pytest.fixture
def cuda_devices(monkeypatch):
    """Makes CTranslate2 see `cuda_devices(count, supported)` GPUs listing the compute types
    `supported` (there is none here)."""
    def install(count, supported=frozenset()):
        monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: count)
        monkeypatch.setattr(ctranslate2, "get_supported_compute_types",
                            lambda device, device_index=0: set(supported) if device == "cuda"
                            else {"float32", "int8", "int8_float32"})
    return install


@pytest.mark.parametrize("count, supported, quantization, options", [
    (0, (), "float32", {"device": "cpu"}),  # in the model's own types, as always
    (0, (), "int8", {"device": "cpu"}),
    (1, TENSOR_CORES, "float32", {"device": "cuda", "compute_type": "float16"}),
    (2, TENSOR_CORES | {"bfloat16", "int8_bfloat16"}, None,
     {"device": "cuda", "compute_type": "float16"}),
    (1, TENSOR_CORES, "int8", {"device": "cuda", "compute_type": "int8_float16"}),
    (1, TENSOR_CORES, "int8_float32", {"device": "cuda", "compute_type": "int8_float16"}),
    (1, NO_TENSOR_CORES, "float32", {"device": "cuda"}),  # the model's types, in float32
])
def test_the_device_is_a_gpu_where_ctranslate2_sees_one(cuda_devices, count, supported,
                                                        quantization, options):
    cuda_devices(count, supported)
    assert device_options(ctranslate2, quantization) == options


def test_the_translator_asks_for_the_gpu_unless_told_a_device(random_export, cuda_devices):
    cuda_devices(1, TENSOR_CORES)
    translator = CTranslate2Translator(random_export)  # not loaded: there is no GPU here
    assert translator.translator is None
    assert translator.translator_options == {"device": "cuda", "compute_type": "float16"}
    assert CTranslate2Translator(random_export, translator_options={"compute_type": "float32"}) \
        .translator_options == {"device": "cuda", "compute_type": "float32"}
    told = CTranslate2Translator(random_export, translator_options={"device": "cpu"})
    assert told.translator_options == {"device": "cpu"}
    assert (told.load().device, told.load().compute_type) == ("cpu", "float32")


@pytest.mark.slow
def test_eval_records_the_device_it_decoded_on(varied_tiny_logdir, exported, tmp_path_factory):
    logdir = copy_of_logdir(varied_tiny_logdir, tmp_path_factory, "device")
    val, references, _ = load_split(MULTI30K, "val")
    (logdir.parent / "a.de").write_text("\n".join(val[:3]) + "\n", encoding="utf-8")
    (logdir.parent / "a.en").write_text("\n".join(references[:3]) + "\n", encoding="utf-8")
    result = run("eval.py", "--logdir", logdir, "--ctranslate2", exported, "--src",
                 logdir.parent / "a.de", "--ref", logdir.parent / "a.en", "--beam_size", 1)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    recorded = json.loads((logdir / filenames.EVAL / "a.json").read_text())
    chosen = device_options(ctranslate2, None)  # the CPU here; CUDA where CTranslate2 sees a GPU
    expected = (chosen["device"], chosen.get("compute_type", "float32"))
    assert (recorded["device"], recorded["compute_type"]) == expected
    assert f"devices: CTranslate2 on {expected[0]} (compute type {expected[1]})\n" in result.stderr
