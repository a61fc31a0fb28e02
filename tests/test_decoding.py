"""Greedy and beam search, the key/value cache, and eval.py (on a model with set weights; the
trained model for what needs learning: BLEU, training's records)."""

import json
import os
import shutil
import sys

import keras
import numpy as np
import pytest
import sacrebleu
import tensorflow as tf

from kyu_transformer import config, filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from kyu_transformer.data.text import load_split
from kyu_transformer.decoding.scoring import length_penalty, sequence_log_probs
from kyu_transformer.decoding.search import (
    BeamSearch, GreedySearch, _top_k_rows, _uniforms, search)
from kyu_transformer.decoding.translator import Translator
from kyu_transformer.layers import DecoderBlock
from kyu_transformer.model import Transformer
from kyu_transformer.training.checkpoints import CheckpointError, list_checkpoints, load_model
from tests.conftest import copy_of_logdir, load_logdir
from tests.programs import run
from tests.test_data import MULTI30K
from tests.test_training import ROOT
from tests.varied_model import clear_greedy_choices


def greedy_search(model, source, max_length):
    """`search` with unscored greedy search: ``(ids (N, L), coverage (N, L, S))``."""
    found = search(model, source, max_length, GreedySearch(alpha=0.0, scores=False))
    return found.ids[:, 0], found.coverage


def beam_search(model, source, max_length, beam_size, alpha, n_best=1):
    """`search` with beam search: ``(ids (N, n_best, L), scores (N, n_best))``, best first."""
    found = search(model, source, max_length, BeamSearch(beam_size, alpha, n_best))
    return found.ids, found.scores


@pytest.fixture(scope="module")
def trained(trained_tiny_logdir, tmp_path_factory):
    """The session's small trained model (with validation BLEU), in a logdir copy."""
    logdir = copy_of_logdir(trained_tiny_logdir, tmp_path_factory, "trained")
    return {"logdir": logdir, "train_output": (logdir / "train_output.txt").read_text()}


@pytest.fixture(scope="module")
def varied(varied_tiny_logdir, tmp_path_factory):
    """The session's model with set weights (outputs that vary and run long), in a logdir copy."""
    logdir = copy_of_logdir(varied_tiny_logdir, tmp_path_factory, "decoding")
    _, model, subwords = load_logdir(logdir)
    sources, _, _ = load_split(MULTI30K, "val")
    return {"logdir": logdir, "model": model, "subwords": subwords,
            "sources": [ids + [EOS_ID] for ids in subwords.encode(sources)
                        if len(ids) < 30][:96]}


def _strip(row):
    """A decoded row as a list, EOS and what follows removed (padding too)."""
    row = list(row)
    return [i for i in (row[:row.index(EOS_ID)] if EOS_ID in row else row) if i]


def _pad(sequences):
    width = max(len(s) for s in sequences)
    return np.array([s + [0] * (width - len(s)) for s in sequences], dtype="int32")


def traced(function, *arguments, **settings):
    """`function(*arguments, **settings)` traced into one graph, as `Translator` runs a search
    (run eagerly, a `while_loop` runs its body op by op: several times slower)."""
    return tf.function(lambda: function(*arguments, **settings), autograph=False)()


@pytest.fixture(scope="module")
def mixed_lengths(varied):
    """300 val and test sources (without EOS), and 6 of 5 joined sentences, longer than maxlen1."""
    val, _, _ = load_split(MULTI30K, "val")
    test, _, _ = load_split(MULTI30K, "test_2016_flickr")
    encode = varied["subwords"].encode
    joined = [sum(encode(val[first:first + 5]), []) for first in range(200, 230, 5)]
    assert all(len(ids) >= varied["model"].maxlen1 for ids in joined)
    return encode(val[:150] + test[:150]) + joined


def _limits(translator, sources):
    """Each source's output limit, as `Translator` documents it."""
    maxlen1 = translator.model.maxlen1
    margin = translator.settings.length_margin
    return [min(translator.max_length, min(len(ids) + 1, maxlen1) + margin)
            for ids in sources]


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_cached_steps_give_the_full_forward_logits(rng, norm_position):
    model = Transformer(60, d_model=16, d_ff=32, num_blocks=2, num_heads=2, maxlen1=12,
                        maxlen2=12, norm_position=norm_position)
    source = rng.integers(4, 60, size=(3, 8)).astype("int32")
    source[1, 5:] = 0
    target = rng.integers(4, 60, size=(3, 7)).astype("int32")
    full = np.asarray(model({"source": source, "target_in": target}))
    memory, source_mask = model.encode(source)
    cache = model.init_cache(memory, source_mask)
    steps = []
    for position in range(7):
        logits, cache, _ = model.decode_step(tf.constant(target[:, position]), position, cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.stack(steps, axis=1), full, atol=1e-5)


def test_reordered_hypotheses_see_only_their_own_history(rng):
    """Beam-search bookkeeping: the cache is never moved, only the history mask.

    Each step, K hypotheses are re-drawn from random parents (as beam search
    does); the logits of every hypothesis must equal the full forward pass of
    its own reconstructed prefix.
    """
    model = Transformer(50, d_model=16, d_ff=32, num_blocks=2, num_heads=2, maxlen1=10,
                        maxlen2=10)
    batch, k, length = 2, 3, 6
    source = rng.integers(4, 50, size=(batch, 7)).astype("int32")
    source[0, 4:] = 0
    memory, source_mask = model.encode(source)
    cache = model.init_cache(memory, source_mask)
    prefixes = np.full((batch, k, 1), BOS_ID, dtype="int32")
    history = np.zeros((batch, k, 0), dtype=bool)
    for step in range(length):
        history = np.concatenate([history, np.broadcast_to(np.eye(k, dtype=bool),
                                                           (batch, k, k))], axis=2)
        logits, cache, _ = model.decode_step(tf.constant(prefixes[:, :, -1]), step, cache,
                                             tf.constant(history))
        full = model({"source": np.repeat(source, k, axis=0),
                      "target_in": prefixes.reshape(batch * k, -1)})[:, -1]
        np.testing.assert_allclose(np.reshape(logits, (batch * k, -1)), full, atol=1e-5)
        parents = rng.integers(0, k, size=(batch, k))
        tokens = rng.integers(4, 50, size=(batch, k, 1)).astype("int32")
        prefixes = np.concatenate(
            [np.take_along_axis(prefixes, parents[:, :, None], axis=1), tokens], axis=2)
        history = np.take_along_axis(history, parents[:, :, None], axis=1)


@pytest.mark.parametrize("vocab", [8000, 997, 60])
def test_two_stage_top_k_equals_top_k(rng, vocab):
    values = rng.normal(size=(37, vocab)).astype("float32")
    best, indices, maxima = _top_k_rows(tf.constant(values), 8)
    expected = np.argsort(-values, axis=1)[:, :8]
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(best, np.take_along_axis(values, expected, axis=1))
    np.testing.assert_array_equal(maxima[:, 0], values.max(axis=1))


@pytest.mark.cpu_exact
def test_batched_beam_search_equals_one_sentence_at_a_time(varied):
    """Sentences leave the batch when finished: nobody else's result may change.

    Assumes a CPU: batches of 24 and of 1 run kernels of other shapes, which on a GPU round
    otherwise and may tip a near-tie between two tokens."""
    model = varied["model"]
    sources = varied["sources"][:24]

    # Compiled as Translator compiles it: one trace for every batch.
    @tf.function(autograph=False, input_signature=[tf.TensorSpec((None, None), tf.int32)])
    def search_padded(source):
        return beam_search(model, source, 40, beam_size=3, alpha=0.6, n_best=2)

    def search(batch):
        return search_padded(tf.constant(_pad(batch), tf.int32))

    batched, batched_scores = search(sources)
    assert len({tuple(row) for row in np.asarray(batched[:, 0])}) >= 8  # outputs differ
    reordered, reordered_scores = search(sources[::-1])  # another order of leaving
    np.testing.assert_array_equal(batched, reordered[::-1])
    np.testing.assert_allclose(batched_scores, reordered_scores[::-1], atol=1e-4)
    for row in (0, 7, 19):
        alone, alone_scores = search([sources[row]])
        np.testing.assert_array_equal(batched[row], alone[0])
        np.testing.assert_allclose(batched_scores[row], alone_scores[0], atol=1e-4)


@pytest.mark.cpu_exact
def test_cached_greedy_equals_recomputing_greedy(varied):
    """Greedy search with the key/value cache gives the outputs of recomputing every prefix.

    Assumes a CPU: a cached step and a whole prefix run other kernels, which on a GPU round
    otherwise and may tip a near-tie between two tokens."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:  # the baseline of the decoding benchmark
        from decode_speed import recompute_greedy_search
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    source = _pad(varied["sources"][:32])
    cached, _ = traced(greedy_search, varied["model"], tf.constant(source), 40)
    recomputed = traced(recompute_greedy_search, varied["model"], tf.constant(source), 40)
    np.testing.assert_array_equal(cached, recomputed)
    # Enough sentences stop before the limit for the stopping to be compared too.
    assert (np.asarray(cached) == EOS_ID).any(axis=1).sum() >= 8


def _beam_of_one(model, source, greedy, limit):
    """What beam search of width 1 returns with alpha 0, found from the greedy outputs.

    Its one alive hypothesis follows greedy search, and at each step the two
    likeliest tokens compete: an EOS among them makes a finished hypothesis
    (the greedy prefix, then EOS), and at the limit the greedy output itself
    is one. The output is the likeliest of those (log-probabilities only fall,
    so stopping early changes nothing).
    """
    greedy = np.asarray(greedy)
    target_in = np.concatenate([np.full((len(greedy), 1), BOS_ID), greedy[:, :-1]], 1)
    logits = np.asarray(model({"source": source, "target_in": target_in.astype("int32")}),
                        "float64")
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    outputs = []
    for row, steps in zip(greedy, log_probs):
        candidates, prefix = [], 0.0
        for step in range(limit):
            if EOS_ID in np.argsort(-steps[step])[:2]:
                candidates.append((prefix + steps[step, EOS_ID], list(row[:step])))
            if row[step] == EOS_ID:
                break
            prefix += steps[step, row[step]]
        else:  # cut at the limit: the output without EOS competes too
            candidates.append((prefix, list(row[:limit])))
        outputs.append(max(candidates)[1])
    return outputs


@pytest.mark.cpu_exact
def test_beam_size_one_is_greedy_search_with_a_finished_pool(varied):
    """Beam search of width 1 follows greedy search; an EOS ranked second ends a rival.

    Assumes a CPU: the searches' cached steps and the expectation's whole outputs run other
    kernels, which on a GPU round otherwise and may tip a near-tie between two tokens."""
    source = tf.constant(_pad(varied["sources"][:32]))
    greedy, _ = traced(greedy_search, varied["model"], source, 40)
    beam, _ = traced(beam_search, varied["model"], source, 40, beam_size=1, alpha=0.0)
    expected = _beam_of_one(varied["model"], source, greedy, 40)
    assert [_strip(row) for row in np.asarray(beam[:, 0])] == expected
    # Both kinds of sentence are there: the greedy output, and an earlier end.
    same = sum(_strip(row) == output for row, output in zip(np.asarray(greedy), expected))
    print(f"{same} of 32 are the greedy output")
    assert same >= 8 and len(expected) - same >= 4, same


def test_beam_search_finds_likelier_outputs_than_greedy(varied):
    model = varied["model"]
    source = tf.constant(_pad(varied["sources"]))
    greedy, _ = traced(greedy_search, model, source, 40)
    beam, scores = traced(beam_search, model, source, 40, beam_size=4, alpha=0.0, n_best=2)
    greedy_log_probs = np.asarray(sequence_log_probs(model, source, greedy))
    beam_log_probs = np.asarray(sequence_log_probs(model, source, beam[:, 0]))
    assert beam_log_probs.mean() >= greedy_log_probs.mean()
    assert beam_log_probs.mean() > greedy_log_probs.mean() + 1e-3  # and it does search
    # with alpha 0 the score is the model log-probability, best first
    np.testing.assert_allclose(scores[:, 0], beam_log_probs, atol=1e-3)
    assert np.all(np.asarray(scores[:, 0]) >= np.asarray(scores[:, 1]))


def test_greedy_scores_are_summed_while_picking_as_forced_decoding_scores_them(varied):
    """No second pass: the scores equal those of the whole outputs decoded again."""
    model = varied["model"]
    source = tf.constant(_pad(varied["sources"][:32]))
    limits = np.array([40, 12, 25, 6] * 8, dtype="int32")
    # Run eagerly (a user's call outside a compiled function; the other tests trace theirs).
    found = search(model, source, tf.constant(limits), GreedySearch(alpha=0.6))
    ids = found.ids[:, 0].numpy()
    lengths = np.count_nonzero(ids, axis=1)
    expected = (sequence_log_probs(model, source, ids).numpy()
                / length_penalty(lengths, 0.6).numpy())
    np.testing.assert_allclose(found.scores[:, 0], expected, rtol=1e-5, atol=1e-5)
    ended = (ids == EOS_ID).any(axis=1)
    assert ended.sum() >= 4 and (~ended).sum() >= 4  # outputs ended by EOS and cut at a limit


@pytest.mark.parametrize("beam_size", [1, 3])
def test_finished_sentences_stay_padded(varied, beam_size):
    translator = Translator(varied["model"], beam_size=beam_size)
    source = tf.constant(_pad(varied["sources"][:32]))
    limits = np.array([40, 12, 25, 6] * 8, dtype="int32")
    rows = tf.range(32)
    ids = translator.search_function(1)(source, limits, rows, tf.constant(0, tf.int64))
    ids = ids.ids[:, 0].numpy()
    assert ids.shape == (32, 40)
    finished = cut = 0
    for row, limit in zip(ids, limits):
        ends = np.flatnonzero(row == EOS_ID)
        if len(ends) == 0:  # cut at its own length limit: padding only after it
            cut += 1
            assert np.all(row[:limit] != 0) and np.all(row[limit:] == 0)
            continue
        finished += 1
        assert ends[0] < limit
        assert np.all(row[ends[0] + 1:] == 0) and np.all(row[:ends[0]] != 0)
    assert finished >= 8 and cut >= 4  # the set weights give enough of both to test this


@pytest.mark.cpu_exact
def test_each_sentence_stops_at_its_own_limit(varied):
    """A sentence of a batch with mixed limits gets what a batch of its own limit gives it.

    Assumes a CPU: rows that end leave the batch at other steps, so its shapes differ, and
    kernels of other shapes on a GPU round otherwise and may tip a near-tie between two tokens."""
    model = varied["model"]
    source = tf.constant(_pad(varied["sources"][:24]))
    limits = np.array([3, 9, 40] * 8, dtype="int32")
    greedy, _ = traced(greedy_search, model, source, tf.constant(limits))
    beam, scores = traced(beam_search, model, source, tf.constant(limits), beam_size=3,
                          alpha=0.6, n_best=2)
    assert greedy.shape == (24, 40) and beam.shape == (24, 2, 40)
    for limit in (3, 9, 40):
        rows = limits == limit
        alike, _ = traced(greedy_search, model, source, limit)
        np.testing.assert_array_equal(np.asarray(greedy)[rows], _widen(alike, 40)[rows])
        alike, alike_scores = traced(beam_search, model, source, limit, beam_size=3,
                                     alpha=0.6, n_best=2)
        np.testing.assert_array_equal(np.asarray(beam)[rows], _widen(alike, 40)[rows])
        np.testing.assert_allclose(np.asarray(scores)[rows], np.asarray(alike_scores)[rows],
                                   atol=1e-5)


def _widen(ids, width):
    """`ids` padded with 0 on its last axis to `width`."""
    ids = np.asarray(ids)
    padding = [(0, 0)] * (ids.ndim - 1) + [(0, width - ids.shape[-1])]
    return np.pad(ids, padding)


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.cpu_exact
def test_a_translation_does_not_depend_on_its_batch(varied, mixed_lengths, beam_size):
    """Alone, or in one batch with much shorter and longer sources: the same output.

    Assumes a CPU: a batch of 1 and one of 306 run kernels of other shapes, which on a GPU round
    otherwise and may tip a near-tie between two tokens."""
    # A small margin makes many outputs stop at their limit, where a limit
    # shared by the batch would show.
    translator = Translator(varied["model"], beam_size=beam_size, length_margin=1,
                            batch_size=len(mixed_lengths))
    found = translator.translate_ids(mixed_lengths)
    together = found.outputs
    # Alone: every third sentence and the six longer than maxlen1 (the last).
    checked = [i for i in range(len(mixed_lengths)) if i % 3 == 0 or i >= len(mixed_lengths) - 6]
    alone = {i: translator.translate_ids([mixed_lengths[i]]).outputs[0] for i in checked}
    assert [i for i in checked if alone[i] != together[i]] == []
    assert len({tuple(output) for output in together}) >= 30  # real, varied outputs
    cut = sum(not found.ended[i][0] for i in checked)
    assert cut >= 10  # and limits were reached


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translator_counts_cut_sources_and_cut_outputs(varied, mixed_lengths, beam_size):
    model = varied["model"]
    counts = []
    for margin in (0, 16):
        translator = Translator(model, beam_size=beam_size, length_margin=margin,
                                batch_size=100)
        found = translator.translate_ids(mixed_lengths)
        outputs = found.outputs
        limits = _limits(translator, mixed_lengths)
        # An output that ended has at most limit - 1 tokens besides its EOS.
        assert all(len(output) <= limit for output, limit in zip(outputs, limits))
        at_limit = sum(len(output) == limit for output, limit in zip(outputs, limits))
        assert found.truncated_outputs == at_limit
        assert found.ended == [[len(output) < limit] if ids else [True] for output, limit, ids
                               in zip(outputs, limits, mixed_lengths)]
        assert found.truncated_sources == sum(len(ids) >= model.maxlen1
                                              for ids in mixed_lengths) >= 6
        counts.append(found.truncated_outputs)
    assert counts[0] > counts[1]


def test_impossible_requests_are_refused(varied):
    model = varied["model"]
    source = tf.constant(_pad(varied["sources"][:2]))
    with pytest.raises(ValueError, match=r"`n_best` \(5\) must be at most `beam_size` \(4\)"):
        beam_search(model, source, 10, beam_size=4, alpha=0.6, n_best=5)
    with pytest.raises(ValueError, match="`with_coverage` needs greedy search.*beam_size=3"):
        Translator(model, beam_size=3).translate_ids([[5, 6, 7]], with_coverage=True)
    with pytest.raises(ValueError, match="`with_coverage` needs greedy search.*sampling"):
        Translator(model, sampling_topk=0).translate_ids([[5, 6, 7]], with_coverage=True)
    with pytest.raises(ValueError, match="`with_log_probs` is not given by Translator"):
        Translator(model, beam_size=1).translate_ids([[5, 6, 7]], with_log_probs=True)
    coverages = Translator(model, beam_size=1).translate_ids([[5, 6, 7], []],
                                                             with_coverage=True).coverages
    assert coverages[0].shape[1] == 4 and coverages[1] is None  # greedy coverage still works
    with pytest.raises(ValueError, match=rf"`max_length` must be in \[1, {model.maxlen2}\]"):
        Translator(model, max_length=model.maxlen2 + 1)
    # One rule (`settings.checked_max_length`) for the settings, the engines and `search`.
    for refused in (lambda: Translator(model, max_length=0),
                    lambda: search(model, source, 0, GreedySearch(alpha=0.6))):
        with pytest.raises(ValueError, match="^`max_length` must be at least 1, got 0$"):
            refused()
    with pytest.raises(ValueError, match="`length_margin` must be at least 0, got -1"):
        Translator(model, length_margin=-1)


def test_empty_source_lines_give_empty_translations(varied):
    translator = Translator(varied["model"], beam_size=2)
    outputs = translator.translate(["Ein Hund.", "", "   ", "Zwei Frauen."], varied["subwords"])
    assert outputs[1] == "" and outputs[2] == ""
    assert outputs[0] and outputs[3]
    assert translator.translate([], varied["subwords"]) == []


def test_training_scored_validation_bleu_and_kept_the_best(trained):
    logdir = trained["logdir"]
    assert "validation BLEU" in trained["train_output"]
    best = json.loads((logdir / "best.json").read_text())
    assert best["epoch"] in (1, 2, 3) and "tok:13a" in best["signature"]
    assert (logdir / "best.weights.h5").is_file() and (logdir / "bleu.png").is_file()
    history = [json.loads(line) for line in (logdir / "history.jsonl").read_text().splitlines()]
    bleus = [r["bleu"] for r in history if r.get("kind") == "eval"]
    assert len(bleus) == 3 and best["bleu"] == max(bleus)
    events = tf.io.gfile.glob(str(logdir / "train" / "events.out.tfevents*"))
    tags = {v.tag for path in events for e in tf.compat.v1.train.summary_iterator(path)
            for v in e.summary.value}
    assert "eval/bleu" in tags


def test_eval_scores_a_split_with_sacrebleu(trained):
    logdir = trained["logdir"]
    result = run("eval.py", "--logdir", logdir, "--split", "val", "--beam_size", 2,
                 "--plot_attention", 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp" in result.stdout
    scores = json.loads((logdir / "eval" / "val.json").read_text())
    for key in ("bleu", "chrf", "signature", "checkpoint", "checkpoints", "beam_size",
                "num_sentences", "seconds", "truncated_sources", "truncated_outputs"):
        assert key in scores
    assert scores["checkpoints"] == list_checkpoints(str(logdir))[-1:]
    _, references, _ = load_split(MULTI30K, "val")
    assert scores["num_sentences"] == len(references) == 300 and scores["beam_size"] == 2
    hypotheses = (logdir / "eval" / "val.hyp.txt").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 300
    expected = sacrebleu.corpus_bleu(hypotheses, [references]).score
    # Far above the tolerance, so that two near-zero figures cannot agree whatever eval.py did;
    # not a bar of quality: that the model learned is its fixture's check, and its BLEU here
    # moves with the seed and the processor's kernels (RESULTS.md, "Test suite").
    assert scores["bleu"] == pytest.approx(expected, abs=0.01) and scores["bleu"] > 0.5
    assert (logdir / "eval" / "val.attention.1.png").is_file()
    assert (logdir / "eval" / "val.attention.2.png").is_file()


def test_eval_translates_files_and_standard_input(varied, tmp_path):
    logdir = varied["logdir"]
    val, val_references, _ = load_split(MULTI30K, "val")
    sources = ["Ein Mann fährt Fahrrad.", "", "Zwei Hunde spielen im Schnee.",
               " ".join(val[:5])]  # longer than maxlen1
    references = ["A man rides a bike.", "", "Two dogs play in the snow.",
                  " ".join(val_references[:5])]
    source, reference = tmp_path / "mine.de", tmp_path / "mine.en"
    source.write_text("".join(line + "\n" for line in sources), "utf-8")
    reference.write_text("".join(line + "\n" for line in references), "utf-8")
    result = run("eval.py", "--logdir", logdir, "--src", source, "--ref", reference,
                 "--average_last", 2, "--beam_size", 1, "--length_margin", 0)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "average of 2 checkpoints" in result.stdout
    lines = (logdir / "eval" / "mine.hyp.txt").read_text(encoding="utf-8").split("\n")
    assert len(lines) == 5 and lines[1] == "" and lines[0] and lines[2]
    scores = json.loads((logdir / "eval" / "mine.json").read_text())
    assert scores["checkpoints"] == list_checkpoints(str(logdir))[-2:]
    # The counts are those of the same translation made here.
    model, _ = load_model(config.load(str(logdir / "hparams.json")), str(logdir), average_last=2)
    found = Translator(model, beam_size=1, length_margin=0).translate_ids(
        varied["subwords"].encode(sources))
    assert scores["truncated_sources"] == found.truncated_sources == 1
    assert scores["truncated_outputs"] == found.truncated_outputs
    assert "note: 1 sentences were longer than maxlen1" in result.stdout
    assert (f"note: {found.truncated_outputs} translations reached their length limit"
            in result.stdout) == (found.truncated_outputs > 0)
    typed = run("eval.py", "--logdir", logdir, "--src", "-",
                stdin="Ein Hund rennt.\nEine Frau singt.\n")
    assert typed.returncode == 0, typed.stderr
    assert len(typed.stdout.strip().splitlines()) == 2


def test_eval_errors_are_clear(varied, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(varied["logdir"], broken)
    (broken / filenames.SUBWORDS).unlink()
    result = run("eval.py", "--logdir", broken)
    assert result.returncode != 0 and "subwords.model: no subword model" in result.stderr
    empty = tmp_path / "empty"
    shutil.copytree(varied["logdir"], empty)
    shutil.rmtree(empty / "checkpoints")
    result = run("eval.py", "--logdir", empty)
    assert result.returncode != 0 and "no checkpoint in" in result.stderr
    result = run("eval.py", "--logdir", tmp_path / "nothing")
    assert result.returncode != 0 and "hparams.json: no such file" in result.stderr
    result = run("eval.py", "--logdir", varied["logdir"], "--ckpt", "best", "--average_last", 2)
    assert result.returncode != 0
    assert "--ckpt (best) and --average_last (2) exclude each other" in result.stderr
    result = run("eval.py", "--logdir", varied["logdir"], "--average_last", 9)
    names = ", ".join(os.path.basename(path) for path in list_checkpoints(str(varied["logdir"])))
    assert result.returncode != 0
    assert f"last 9 checkpoints (average_last=9), but 3 exist: {names}" in result.stderr
    other = config.load(str(varied["logdir"] / "hparams.json"))
    other["d_model"] = 32
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_model(other, str(varied["logdir"]))


@pytest.mark.slow  # starts a program
def test_the_search_knows_no_corpus():
    """decoding (and the exports built on it) take the special ids from `conventions`."""
    script = ("import sys; import kyu_transformer.decoding.search, "
              "kyu_transformer.decoding.translator, kyu_transformer.export.saved_model; "
              "print(any(m.startswith('kyu_transformer.data') for m in sys.modules))")
    result = run("-c", script, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)


def test_the_beam_cache_layout_is_the_searchs(rng):
    """Slot ``l * K + j`` is position `l` of hypothesis `j`; the block does not guess it."""
    from kyu_transformer.decoding.search import own_history
    expected = np.array([[[slot % 3 == j for slot in range(6)] for j in range(3)]])
    np.testing.assert_array_equal(own_history(2, 3), expected)
    # A decoder step does not guess the layout: several queries need their mask.
    model = Transformer(50, d_model=16, d_ff=32, num_blocks=1, num_heads=2, maxlen1=10,
                        maxlen2=10)
    memory, source_mask = model.encode(rng.integers(4, 50, size=(2, 5)).astype("int32"))
    cache = model.init_cache(memory, source_mask)
    with pytest.raises(ValueError, match="3 queries per sentence need a `self_attention_mask`"):
        model.decode_step(tf.constant(np.full((2, 3), 2, "int32")), 0, cache)
    logits, _, _ = model.decode_step(tf.constant(np.full((2, 3), 2, "int32")), 0, cache,
                                     tf.constant(np.broadcast_to(expected[:, :, :3], (2, 3, 3))))
    assert logits.shape == (2, 3, 50)


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_a_decoder_block_decodes_with_the_call_it_trains_with(rng, norm_position):
    """One `call`: position by position with a cache, the outputs of the whole sequence."""
    model = Transformer(50, d_model=16, d_ff=32, num_blocks=1, num_heads=2, maxlen1=10,
                        maxlen2=10, norm_position=norm_position)
    source = rng.integers(4, 50, size=(2, 5)).astype("int32")
    source[1, 3:] = 0
    memory, source_mask = model.encode(source)
    block = model.decoder_blocks[0]
    inputs = tf.constant(rng.normal(size=(2, 4, 16)).astype("float32"))
    whole, weights, coverage = block(inputs, memory, memory_mask=source_mask,
                                     return_attention_scores=True)
    cache = block.init_cache(memory)
    assert cache["self"][0].shape == (2, 2, 0, 8) and cache["cross"][0].shape == (2, 2, 5, 8)
    for position in range(4):
        outputs, step_weights, step_coverage, cache = block(
            inputs[:, position:position + 1], memory, memory_mask=source_mask, cache=cache,
            return_attention_scores=True)
        assert cache["self"][0].shape[2] == position + 1
        np.testing.assert_allclose(outputs[:, 0], whole[:, position], atol=1e-5)
        np.testing.assert_allclose(step_weights[:, :, 0], weights[:, :, position], atol=1e-6)
        np.testing.assert_allclose(step_coverage[:, 0], coverage[:, position], atol=1e-6)
    # the memory's keys and values are projected once: the cache holds them unchanged
    np.testing.assert_array_equal(cache["cross"][0],
                                  block.cross_attention.project_keys_values(memory)[0])


def test_a_decoder_block_over_a_wider_memory_decodes_with_its_own_head_width(rng):
    block = DecoderBlock(num_heads=2, d_ff=32)
    inputs = tf.constant(rng.normal(size=(2, 3, 16)).astype("float32"))
    memory = tf.constant(rng.normal(size=(2, 5, 24)).astype("float32"))
    whole = block(inputs, memory)
    cache = block.init_cache(memory)
    assert cache["self"][0].shape == (2, 2, 0, 8)  # the block's heads, not the memory's width
    for position in range(3):
        outputs, cache = block(inputs[:, position:position + 1], memory, cache=cache)
        np.testing.assert_allclose(outputs[:, 0], whole[:, position], atol=1e-5)


# ------------------------------------------------------------------ sampling


def test_sampling_near_temperature_zero_is_greedy_search(varied, mixed_lengths):
    """Top-k 0 at temperature 1e-3: the largest logit is drawn every time, scored as greedy.

    On the sentences whose greedy choices each lead the runner-up by 0.05 in
    logit (at temperature 1e-3, the runner-up's chance is then below e^-50);
    a near-tie may go either way when sampling."""
    model = varied["model"]
    greedy = Translator(model, beam_size=1).translate_ids(mixed_lengths, n_best=1)
    cold = Translator(model, sampling_topk=0, sampling_temperature=1e-3).translate_ids(
        mixed_lengths, n_best=1)
    clear = clear_greedy_choices(model, mixed_lengths, greedy, margin=0.05)
    assert len(clear) >= 0.5 * len(mixed_lengths)
    assert [cold.hypotheses[i] for i in clear] == [greedy.hypotheses[i] for i in clear]
    assert sum(not greedy.ended[i][0] for i in clear) >= 10  # outputs cut at their limit too
    np.testing.assert_allclose([cold.scores[i] for i in clear],
                               [greedy.scores[i] for i in clear], rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_exact
def test_samples_follow_their_seed_not_their_batch(varied, mixed_lengths):
    """A seed repeats its samples, another draws others; batches and neighbours change none.

    Also: `n_best` samples (more than a beam), best first, duplicates kept,
    each scored as forced decoding scores it. Assumes a CPU where it compares the first
    sentence alone and in a batch of 128 exactly: kernels of other shapes, on a GPU, round
    otherwise and may move a logit across a draw's boundary."""
    model = varied["model"]
    translator = Translator(model, sampling_topk=0, batch_size=128)
    first = translator.translate_ids(mixed_lengths, n_best=6, seed=11)
    assert translator.translate_ids(mixed_lengths, n_best=6, seed=11) == first
    # One sentence a batch: the same random numbers, so the same draws, except
    # where the batch shape moved a logit's last bits across a draw's boundary
    # (about one draw in 30,000 here: the outputs are long and their
    # distributions flat), or the order of two samples scored alike.
    # The first 80 sentences (the same indices, so the same streams), one a batch.
    alone = Translator(model, sampling_topk=0, batch_size=1).translate_ids(
        mixed_lengths[:80], n_best=6, seed=11)
    same = [i for i, (a, b) in enumerate(zip(alone.hypotheses, first.hypotheses))
            if sorted(map(tuple, a)) == sorted(map(tuple, b))]
    assert len(same) >= 78
    np.testing.assert_allclose([alone.scores[i] for i in same], [first.scores[i] for i in same],
                               rtol=1e-5, atol=1e-5)
    assert translator.translate_ids(mixed_lengths[:1], n_best=6, seed=11).hypotheses == \
        first.hypotheses[:1]
    other = translator.translate_ids(mixed_lengths, n_best=6, seed=12)
    differ = sum(a != b for a, b in zip(first.hypotheses, other.hypotheses))
    assert differ >= 0.9 * len(mixed_lengths)
    assert all(len(row) == 6 and row == sorted(row, reverse=True) for row in first.scores)
    assert sum(len({tuple(h) for h in row}) for row in first.hypotheses) > 3 * len(mixed_lengths)
    ended = [(i, j) for i, row in enumerate(first.ended) for j, end in enumerate(row)
             if end and mixed_lengths[i]][:200]
    rescored, _ = translator.score_ids([mixed_lengths[i] for i, _ in ended],
                                       [first.hypotheses[i][j] for i, j in ended])
    np.testing.assert_allclose([first.scores[i][j] for i, j in ended],
                               [result.score for result in rescored], rtol=1e-4, atol=1e-4)


def test_each_sentence_and_sample_has_its_own_random_stream():
    """The numbers drawn for (seed, sentence, sample, step) are the same in any batch, and
    uniform: a batch's rows are its sentences, in any order, alone or not."""
    sentences = tf.constant([4, 0, 9, 4000000], tf.int32)
    together = _uniforms(7, sentences, 3, 5).numpy()  # (4, 3)
    for row in range(4):
        alone = _uniforms(7, sentences[row:row + 1], 3, 5).numpy()
        np.testing.assert_array_equal(alone[0], together[row])
    np.testing.assert_array_equal(together[0, :2], _uniforms(7, sentences[:1], 2, 5)[0])
    assert not np.any(together == _uniforms(8, sentences, 3, 5).numpy())  # another seed
    assert not np.any(together == _uniforms(7, sentences, 3, 6).numpy())  # another step
    many = _uniforms(1, tf.range(20000), 5, 3).numpy().ravel()
    assert many.min() >= 0.0 and many.max() < 1.0
    counts = np.histogram(many, bins=20, range=(0, 1))[0]
    assert np.all(np.abs(counts - 5000) < 5 * np.sqrt(5000))
    assert abs(np.corrcoef(many[:-1], many[1:])[0, 1]) < 0.02


def _tiny_model():
    keras.utils.set_random_seed(3)
    model = Transformer(24, d_model=16, d_ff=32, num_blocks=1, num_heads=2, maxlen1=8,
                        maxlen2=8, dropout_rate=0.0)
    model.build()
    return model


def test_sampling_settings_hold_at_their_limits():
    """Top-k above the vocabulary is the vocabulary; temperatures from float32's smallest to
    1e30 draw no PAD or BOS and no NaN; sampling settings without sampling are refused."""
    model = _tiny_model()
    sources = [[5, 6, 7], [8, 9], [10]] * 20
    for fields in (dict(sampling_topk=1000), dict(sampling_topk=0, sampling_temperature=1e30),
                   dict(sampling_topk=0, sampling_temperature=2e-38)):
        found = Translator(model, max_length=6, **fields).translate_ids(sources, n_best=4)
        drawn = {i for row in found.hypotheses for output in row for i in output}
        assert drawn and not drawn & {PAD_ID, BOS_ID}, fields
        assert np.all(np.isfinite(found.scores)), fields
    for name, value in (("sampling_topp", 0.9), ("sampling_temperature", 0.5)):
        with pytest.raises(ValueError, match=f"`{name}` applies to sampling"):
            Translator(model, **{name: value})
    with pytest.raises(ValueError, match="`seed` must be below 4294967295"):
        Translator(model, sampling_topk=0).translate_ids(sources, seed=2**32)


def _cut_softmax(logits, topk, topp, temperature):
    """The distribution sampling draws from: softmax(logits / T) without PAD and BOS (no
    output tokens), cut to top-k then top-p."""
    logits = logits.copy()
    logits[[PAD_ID, BOS_ID]] = -np.inf
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    keep[order[:topk or len(probs)]] = True
    kept = np.where(keep, probs, 0.0) / probs[keep].sum()
    before = np.cumsum(kept[order]) - kept[order]  # mass of the tokens ranked above
    keep[order[before >= topp]] = False
    cut = np.where(keep, probs, 0.0)
    return cut / cut.sum()


@pytest.mark.parametrize("topk, topp, temperature",
                         [(0, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.6, 1.5), (4, 0.8, 1.0)])
def test_first_tokens_are_drawn_from_the_cut_softmax(topk, topp, temperature):
    """4,000 first tokens of one source: frequencies within 5 standard deviations of the
    reference probabilities, and never a token the cuts remove, nor PAD or BOS."""
    model = _tiny_model()
    source = np.array([[5, 6, 7, EOS_ID]], "int32")
    logits = np.asarray(model({"source": source, "target_in": np.array([[BOS_ID]])}),
                        "float64")[0, 0]
    expected = _cut_softmax(logits, topk, topp, temperature)
    assert 3 <= np.count_nonzero(expected) and expected.max() < 0.8  # a real choice
    rows, samples = 250, 16
    translator = Translator(model, sampling_topk=topk, sampling_topp=topp,
                            sampling_temperature=temperature, max_length=1)
    found = translator.search_function(samples)(
        tf.constant(np.repeat(source, rows, axis=0)), tf.ones(rows, tf.int32),
        tf.range(rows), tf.constant(7, tf.int64))
    counts = np.bincount(found.ids.numpy()[:, :, 0].ravel(), minlength=24)
    draws = rows * samples
    assert np.all(counts[expected == 0] == 0) and counts[PAD_ID] == counts[BOS_ID] == 0
    tolerance = 5 * np.sqrt(expected * (1 - expected) / draws) + 1 / draws
    assert np.all(np.abs(counts / draws - expected) <= tolerance), (counts / draws, expected)
