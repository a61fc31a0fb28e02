"""The regularizers a small corpus needs: dropout of attention weights, of the feed-forward's
inner activations and of whole token embeddings, LayerDrop (whole blocks), a schedule that
decays to the end of the run, and subword regularization (sampled segmentations of the training
side)."""

import math

import numpy as np
import pytest

import hparams as hp
from kyu_transformer import config
from kyu_transformer.data.subwords import SegmentationSampler, Subwords
from kyu_transformer.data.text import load_split
from kyu_transformer.layers import EncoderBlock, FeedForward, LayerDrop
from kyu_transformer.model import Transformer
from kyu_transformer.training.schedule import NoamSchedule
from tests import programs
from tests.test_data import MULTI30K, lists_of

SIZE = dict(vocab_size=60, d_model=16, d_ff=32, num_blocks=1, num_heads=2, maxlen1=64,
            maxlen2=64)


def five_sigma(rate, count):
    """Five standard deviations of the fraction of `count` draws that fall with `rate`."""
    return 5 * math.sqrt(rate * (1 - rate) / count)


# ------------------------------------------------------------------ dropout rates

def test_feed_forward_inner_dropout_drops_its_rate_of_the_inner_activations(rng):
    """Identity kernels and a bias of 1 make the inner activations ``relu(LN(x) + 1)``, and in
    pre-norm the output is ``x`` plus them: each is dropped (0) or scaled by 1 / (1 - rate)."""
    rate, width = 0.3, 64
    layer = FeedForward((width, width), inner_dropout_rate=rate, norm_position="pre")
    x = rng.normal(size=(8, 40, width)).astype("float32")
    layer.build(x.shape)
    for dense in (layer.inner_dense, layer.outer_dense):
        dense.kernel.assign(np.eye(width, dtype="float32"))
    layer.inner_dense.bias.assign(np.ones(width, dtype="float32"))
    inner = np.asarray(layer(x)) - x  # not training: the activations themselves
    np.testing.assert_allclose(inner, np.maximum(np.asarray(layer.norm(x)) + 1, 0), atol=1e-5)
    dropped = np.asarray(layer(x, training=True)) - x
    live = inner > 1e-3
    kept = np.isclose(dropped, inner / (1 - rate), rtol=1e-4, atol=1e-5)
    assert np.all(kept | (np.abs(dropped) < 1e-5))  # nothing else happens to them
    share = 1 - kept[live].mean()
    assert abs(share - rate) < five_sigma(rate, live.sum()), share
    assert layer.dropout.rate == 0  # the residual dropout stays its own
    # the layer's config carries the rate; a config without it (older files) means 0
    assert FeedForward.from_config(layer.get_config()).inner_dropout_rate == rate
    config = {key: value for key, value in layer.get_config().items()
              if key != "inner_dropout_rate"}
    assert FeedForward.from_config(config).inner_dropout_rate == 0


def test_attention_dropout_drops_its_rate_of_the_attention_weights(rng):
    """With the values an identity, the outputs are the attention weights after dropout: each
    one dropped (0) or scaled by 1 / (1 - rate); the block's `attention_dropout_rate` sets it."""
    rate, keys = 0.25, 32
    block = EncoderBlock(num_heads=2, d_ff=16, dropout_rate=0.0, attention_dropout_rate=rate)
    block.build((4, keys, 8))
    attention = block.self_attention.attention
    assert attention.dropout.rate == rate and block.feed_forward.dropout.rate == 0
    q = rng.normal(size=(4, 2, keys, 8)).astype("float32")
    k = rng.normal(size=(4, 2, keys, 8)).astype("float32")
    v = np.broadcast_to(np.eye(keys, dtype="float32"), (4, 2, keys, keys))
    outputs, weights = (np.asarray(x) for x in attention(q, k, v, training=True))
    kept = np.isclose(outputs, weights / (1 - rate), rtol=1e-5, atol=1e-7)
    assert np.all(kept | (outputs == 0))
    share = 1 - kept.mean()
    assert abs(share - rate) < five_sigma(rate, kept.size), share
    np.testing.assert_allclose(attention(q, k, v)[0], weights, rtol=1e-5, atol=1e-7)


def test_word_dropout_drops_whole_token_embeddings_at_its_rate(rng):
    """With no blocks and no other dropout, the encoder's output is the token embedding plus
    its position: a dropped token keeps only its position, a kept one its embedding scaled
    by 1 / (1 - rate), the same for all its channels."""
    rate = 0.25
    model = Transformer(**{**SIZE, "num_blocks": 0, "dropout_rate": 0.0, "word_dropout": rate})
    source = rng.integers(4, 60, size=(64, 50))
    source[:, 45:] = 0
    embedded = np.asarray(model.source_embedding(source))  # (N, S, C)
    positions = np.asarray(model.source_positions(source))
    np.testing.assert_allclose(model.encode(source)[0], embedded + positions, atol=1e-6)
    outputs = np.asarray(model.encode(source, training=True)[0])
    kept = np.isclose(outputs, embedded / (1 - rate) + positions, atol=1e-5).all(-1)
    dropped = np.isclose(outputs, positions, atol=1e-6).all(-1)
    tokens = source != 0
    assert np.all((kept ^ dropped)[tokens])  # each token whole, one way or the other
    share = dropped[tokens].mean()
    assert abs(share - rate) < five_sigma(rate, tokens.sum()), share
    target = np.asarray(model.decode(source[:, :10], *model.encode(source), training=True))
    assert not np.allclose(target, model.decode(source[:, :10], *model.encode(source)))


def test_layer_drop_passes_a_whole_block_or_its_inputs_at_its_rate(rng):
    """`LayerDrop` gives the block's outputs or, with probability `rate`, its inputs, whole;
    outside training always the outputs."""
    rate, draws = 0.3, 400
    layer = LayerDrop(rate)
    inputs = rng.normal(size=(2, 3, 4)).astype("float32")
    outputs = inputs + 1.0
    given = [np.asarray(layer(inputs, outputs, training=True)) for _ in range(draws)]
    dropped = [np.array_equal(value, inputs) for value in given]
    assert all(d or np.array_equal(value, outputs) for d, value in zip(dropped, given))
    assert abs(np.mean(dropped) - rate) < five_sigma(rate, draws), np.mean(dropped)
    for _ in range(20):  # not training: never (a layer that dropped would show: 0.7^20)
        np.testing.assert_array_equal(layer(inputs, outputs), outputs)
    assert LayerDrop.from_config(layer.get_config()).rate == rate


def test_layer_dropout_drops_whole_encoder_and_decoder_blocks_in_training(rng):
    """With no other dropout, each training pass of a stack of two blocks gives what its blocks
    give with some of them left out: one of four patterns, each block dropped on its own."""
    model = Transformer(**{**SIZE, "num_blocks": 2, "dropout_rate": 0.0}, layer_dropout=0.5)
    source = rng.integers(4, 60, size=(3, 9))
    source[0, 6:] = 0
    target = source[:, :5]
    memory, source_mask = model.encode(source)
    table = model.target_embedding.table()
    stacks = {
        "encoder": (model.encoder_blocks, np.asarray(
            model.source_embedding(source) + model.source_positions(source)),
            dict(mask=source != 0), lambda x: x,
            lambda training: model.encode(source, training=training)[0]),
        "decoder": (model.decoder_blocks, np.asarray(
            model.target_embedding(target, table=table) + model.target_positions(target)),
            dict(memory=memory, mask=target != 0, memory_mask=source_mask),
            lambda x: model.target_embedding.attend(x, table=table),
            lambda training: model.decode(target, memory, source_mask, training=training))}
    for name, (blocks, embedded, arguments, end, run) in stacks.items():
        patterns = {}
        for kept in ((0, 1), (0,), (1,), ()):
            x = embedded
            for index in kept:
                x = blocks[index](x, **arguments)
            patterns[kept] = np.asarray(end(x))
        np.testing.assert_allclose(run(False), patterns[(0, 1)], atol=1e-5)  # not training
        seen = []
        for draw in range(16):
            given = np.asarray(run(True))
            seen += [kept for kept, value in patterns.items()
                     if np.allclose(given, value, atol=1e-5)]
            assert len(seen) == draw + 1, (name, seen)  # exactly one pattern each time
        # both kept, both dropped or one of them: at 0.5 each, three or four of the four
        # (two or fewer: p ~ 1e-4; two blocks dropped together would give two)
        assert len(set(seen)) >= 3, (name, seen)


def dropout_rates(model):
    """Each dropout's rate by its place: attention weights, feed-forward inner, residual."""
    rates = {"attention": set(), "inner": set(), "residual": set()}
    for layer in model._flatten_layers():
        if hasattr(layer, "attention") and hasattr(layer, "residual_dropout"):
            rates["attention"].add(layer.attention.dropout.rate)
            rates["residual"].add(layer.residual_dropout.rate)
        if isinstance(layer, FeedForward):
            rates["inner"].add(layer.inner_dropout.rate)
            rates["residual"].add(layer.dropout.rate)
    return rates


def random_state_count(model):
    return sum(1 for variable in model.variables if "seed_generator" in variable.path)


def test_dropout_rates_reach_their_places_and_default_to_the_earlier_model():
    model = Transformer(**SIZE, dropout_rate=0.3, attention_dropout=0.1, relu_dropout=0.2,
                        word_dropout=0.05)
    model.build()
    assert dropout_rates(model) == {"attention": {0.1}, "inner": {0.2}, "residual": {0.3}}
    assert model.source_dropout.rate == model.target_dropout.rate == 0.3
    assert model.source_word_dropout.rate == model.target_word_dropout.rate == 0.05
    again = Transformer.from_config(model.get_config())
    again.build()
    assert dropout_rates(again) == dropout_rates(model)
    # by default: attention dropout is `dropout_rate`, the others are off and have no random
    # state (2 embedding dropouts, 2 + 1 in the encoder block, 2 + 2 + 1 in the decoder's)
    plain = Transformer(**SIZE, dropout_rate=0.3)
    plain.build()
    assert dropout_rates(plain) == {"attention": {0.3}, "inner": {0.0}, "residual": {0.3}}
    assert plain.word_dropout == 0.0 and random_state_count(plain) == 10
    assert random_state_count(model) == 10 + 2 + 2  # two inner, two word dropouts
    # LayerDrop: one random state more, made only when used
    dropping = Transformer.from_config({**plain.get_config(), "layer_dropout": 0.1})
    dropping.build()
    assert dropping.layer_drop.rate == 0.1 and plain.layer_drop is None
    assert random_state_count(dropping) == 10 + 1
    same = Transformer.from_hparams({**SIZE, "dropout_rate": 0.2, "attention_dropout": -1})
    assert same.attention_dropout == 0.2  # hparams' -1: the dropout rate
    with pytest.raises(ValueError, match=r"`relu_dropout` must be in \[0, 1\), got 1.0"):
        Transformer(**SIZE, relu_dropout=1.0)


def test_hparams_reach_the_model_and_files_without_them_keep_todays_rates(tmp_path):
    hparams = hp.parse("tiny", {"dropout_rate": "0.3", "relu_dropout": "0.1",
                                "attention_dropout": "0.0", "word_dropout": "0.1",
                                "layer_dropout": "0.2", "embedding_init": "normal"})
    model = Transformer.from_hparams(hparams)
    model.build()
    assert dropout_rates(model) == {"attention": {0.0}, "inner": {0.1}, "residual": {0.3}}
    assert model.source_word_dropout.rate == 0.1 and model.layer_drop.rate == 0.2
    assert model.embedding_init == "normal"
    older = hp.parse("tiny", {"dropout_rate": "0.3"})
    for key in ("attention_dropout", "relu_dropout", "word_dropout", "subword_alpha",
                "decay_steps", "layer_dropout", "embedding_init"):
        del older[key]
    path = tmp_path / "hparams.json"
    config.save(older, str(path))
    loaded = config.load(str(path))
    assert (loaded["attention_dropout"], loaded["relu_dropout"], loaded["word_dropout"],
            loaded["subword_alpha"], loaded["decay_steps"], loaded["layer_dropout"],
            loaded["embedding_init"]) == (-1.0, 0.0, 0.0, 0.0, 0, 0.0, "glorot")
    model = Transformer.from_hparams(loaded)
    model.build()
    assert dropout_rates(model) == {"attention": {0.3}, "inner": {0.0}, "residual": {0.3}}
    assert model.embedding_init == "glorot"


@pytest.mark.parametrize("overrides,message", [
    ({"attention_dropout": "1.0"}, "`attention_dropout` must be in [0, 1) or -1 (as "
                                   "dropout_rate), got 1.0"),
    ({"attention_dropout": "-0.5"}, "`attention_dropout` must be in [0, 1) or -1"),
    ({"relu_dropout": "-0.1"}, "`relu_dropout` must be in [0, 1), got -0.1"),
    ({"word_dropout": "1"}, "`word_dropout` must be in [0, 1), got 1.0"),
    ({"layer_dropout": "1"}, "`layer_dropout` must be in [0, 1), got 1.0"),
    ({"subword_alpha": "-1"}, "`subword_alpha` must be >= 0, got -1.0"),
    ({"subword_alpha": "0.5", "subword_model_type": "bpe"},
     "`subword_alpha` samples segmentations of a unigram model; `subword_model_type` is 'bpe'"),
    ({"decay_steps": "40"}, "`decay_steps` (40) must be 0 or more than `warmup_steps` (40)"),
    ({"decay_steps": "-5"}, "`decay_steps` must be >= 0, got -5"),
    ({"embedding_init": "uniform"}, "`embedding_init` must be one of glorot, normal, got "
                                    "'uniform'"),
])
def test_bad_settings_are_refused(overrides, message):
    with pytest.raises(config.HParamsError) as error:
        hp.parse("tiny", overrides)
    assert message in str(error.value)


# Dropout under MirroredStrategy on two logical CPUs, and the same layers on one device; the
# masks go to sys.argv[2] as ``{name}-{call}-{where}`` (where: one device, replica 0, 1).
REPLICAS_SCRIPT = r"""
import sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, sys.argv[1])
from kyu_transformer import fast_paths
from kyu_transformer.layers import Dropout, LayerDrop

mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = tf.ones((8, 16, 32))
masks = {}
for name, fast, noise_shape in (("fast", True, None), ("plain", False, None),
                                ("words", True, (None, None, 1))):
    fast_paths.set_enabled(fast)
    alone = Dropout(0.5, noise_shape=noise_shape, seed=11)
    with mirrored.scope():
        replicated = Dropout(0.5, noise_shape=noise_shape, seed=11)
    step = tf.function(lambda layer=replicated: mirrored.run(lambda: layer(x, training=True)))
    for call in range(2):
        masks[f"{name}-{call}-alone"] = alone(x, training=True).numpy() != 0
        for replica, outputs in enumerate(mirrored.experimental_local_results(step())):
            masks[f"{name}-{call}-{replica}"] = outputs.numpy() != 0
# LayerDrop: 40 calls, each a choice of the outputs (ones) or the inputs (zeros)
zeros, ones = tf.zeros(()), tf.ones(())
alone = LayerDrop(0.5, seed=5)
with mirrored.scope():
    replicated = LayerDrop(0.5, seed=5)
step = tf.function(lambda: mirrored.run(lambda: replicated(zeros, ones, training=True)))
kept = [[float(value) for value in mirrored.experimental_local_results(step())]
        for _ in range(40)]
masks["blocks-alone"] = [float(alone(zeros, ones, training=True)) == 1.0 for _ in range(40)]
masks["blocks-0"], masks["blocks-1"] = (np.array(column) == 1.0 for column in zip(*kept))
np.savez(sys.argv[2], **masks)
"""


@pytest.mark.slow  # starts a program
@pytest.mark.tensorflow_only("tf.distribute.MirroredStrategy")
def test_replicas_draw_their_own_dropout_masks_and_the_first_draws_one_devices(tmp_path):
    """The same inputs on two replicas: each replica drops its own elements (fast paths on
    and off, and word dropout's Keras path with a `noise_shape`), in each call anew, and its
    own blocks (LayerDrop); replica 0 drops what the same layer (seed) drops on one device."""
    output = programs.run("-c", REPLICAS_SCRIPT, programs.ROOT, tmp_path / "masks.npz",
                          timeout=300)
    assert output.returncode == 0, output.stderr[-3000:]
    masks = np.load(tmp_path / "masks.npz")
    for name in ("fast", "plain", "words"):
        for call in range(2):
            first, second = masks[f"{name}-{call}-0"], masks[f"{name}-{call}-1"]
            np.testing.assert_array_equal(first, masks[f"{name}-{call}-alone"])
            assert abs(first.mean() - 0.5) < 0.1 and abs(second.mean() - 0.5) < 0.1
            # half the elements differ between two independent masks of rate 0.5
            assert abs((first != second).mean() - 0.5) < 0.1, (name, call)
        assert not np.array_equal(masks[f"{name}-0-1"], masks[f"{name}-1-1"])
    first, second = masks["blocks-0"], masks["blocks-1"]
    np.testing.assert_array_equal(first, masks["blocks-alone"])
    assert 8 <= first.sum() <= 32 and 8 <= second.sum() <= 32  # kept at about 0.5
    assert 8 <= (first != second).sum() <= 32  # two draws, not one


# One worker of two under MultiWorkerMirroredStrategy (the cluster in TF_CONFIG), one replica
# each: its mask goes to sys.argv[2], the same layer's on this worker alone to sys.argv[3].
WORKER_SCRIPT = r"""
import sys
import numpy as np, tensorflow as tf
sys.path.insert(0, sys.argv[1])
from kyu_transformer.layers import Dropout

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = tf.ones((8, 16, 32))
with strategy.scope():
    layer = Dropout(0.5, seed=11)
step = tf.function(lambda: strategy.run(lambda: layer(x, training=True)))
(outputs,) = strategy.experimental_local_results(step())
np.save(sys.argv[2], outputs.numpy() != 0)
np.save(sys.argv[3], Dropout(0.5, seed=11)(x, training=True).numpy() != 0)
"""


@pytest.mark.slow  # starts two programs
@pytest.mark.tensorflow_only("tf.distribute.MultiWorkerMirroredStrategy")
def test_workers_draw_their_own_dropout_masks(tmp_path):
    """Two workers of one replica each: the second worker's replica (id 1 of the cluster's
    two) drops other elements than the first's, which drops what one device does."""
    processes = [programs.start("-c", WORKER_SCRIPT, programs.ROOT,
                                tmp_path / f"replica{index}.npy", tmp_path / f"alone{index}.npy",
                                env=programs.environment(TF_CONFIG=config))
                 for index, config in enumerate(programs.cluster_configs(2))]
    programs.finish_all(processes)
    first, second, alone = (np.load(tmp_path / name)
                            for name in ("replica0.npy", "replica1.npy", "alone1.npy"))
    np.testing.assert_array_equal(first, alone)
    assert abs((first != second).mean() - 0.5) < 0.1


# ------------------------------------------------------------------- the schedule

def test_decay_scales_the_noam_rate_down_to_zero_at_decay_steps():
    warmup, end = 100, 1000
    plain = NoamSchedule(d_model=256, warmup_steps=warmup, lr=2.0)
    decayed = NoamSchedule(d_model=256, warmup_steps=warmup, lr=2.0, decay_steps=end)
    for step in (1, 50, 100, 101, 400, 999, 1000, 1001, 1500):
        noam = 2.0 * 256 ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        assert float(plain(step - 1)) == pytest.approx(noam, rel=1e-6)
        expected = noam * min(1.0, max(0.0, (end - step) / (end - warmup)))
        assert float(decayed(step - 1)) == pytest.approx(expected, rel=1e-5, abs=1e-12)
    assert float(decayed(end - 1)) == 0.0 < float(decayed(end - 2))
    assert NoamSchedule.from_config(decayed.get_config()).decay_steps == end
    with pytest.raises(ValueError, match="must be 0 or more than `warmup_steps`"):
        NoamSchedule(256, warmup_steps=100, decay_steps=100)


# ---------------------------------------------------------- subword regularization

@pytest.fixture(scope="module")
def subwords(tmp_path_factory):
    sources, targets, _ = load_split(MULTI30K, "train")
    return Subwords.train_or_load(str(tmp_path_factory.mktemp("subwords")),
                                  sources + targets, vocab_size=400)


@pytest.mark.slow  # starts a program
def test_sampled_segmentations_spell_the_sentence_and_follow_the_seed(subwords):
    sentences = load_split(MULTI30K, "train")[0][:300]
    sampler = SegmentationSampler(subwords, sentences, alpha=0.5)
    first = lists_of(sampler.draw([42, 0]))
    assert [subwords.decode(ids) for ids in first] == sentences
    assert first == lists_of(sampler.draw([42, 0]))
    other_epoch = lists_of(sampler.draw([42, 1]))
    changed = sum(a != b for a, b in zip(first, other_epoch))
    assert changed > len(sentences) // 2, changed
    best = subwords.encode(sentences)
    assert [sampler.candidates(i)[0] for i in range(len(sentences))] == best
    assert sum(a != b for a, b in zip(first, best)) > len(sentences) // 2
    # another process draws the same segmentations for the same seed
    script = ("import sys; from kyu_transformer.data.subwords import SegmentationSampler, "
              "Subwords; s = Subwords(sys.argv[1]); "
              "lines = sys.stdin.read().splitlines(); "
              "d = SegmentationSampler(s, lines, 0.5).draw([42, 0]); "
              "print([d.sentence(row).tolist() for row in range(len(d))])")
    other = programs.run("-c", script, subwords.path, stdin="\n".join(sentences), timeout=120)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == str(first)


def test_each_segmentation_is_drawn_with_probability_proportional_to_p_to_the_alpha(subwords):
    sentence, alpha, draws = "Ein Mann mit einem orangefarbenen Hut.", 0.5, 4000
    sampler = SegmentationSampler(subwords, [sentence], alpha=alpha)
    candidates = [tuple(ids) for ids in sampler.candidates(0)]
    assert len(candidates) == 16 and len(set(candidates)) == 16
    assert np.all(np.diff(sampler.scores) <= 0)  # the n-best order, as `candidates` gives them
    counts = np.zeros(len(candidates))
    for seed in range(draws):
        counts[candidates.index(tuple(sampler.draw([seed]).sentence(0).tolist()))] += 1
    expected = np.exp(alpha * (sampler.scores - sampler.scores.max()))
    expected /= expected.sum()
    for share, probability in zip(counts / draws, expected):
        assert abs(share - probability) < five_sigma(probability, draws), (share, probability)


def test_candidate_scores_are_sentencepieces_but_for_unknown_characters(subwords):
    """The n-best scores SentencePiece gives (summed there in float32), where a sentence has
    no unknown character; where it has, the same penalty in every candidate of the sentence,
    which ours leave out: a constant, which a draw among them does not see."""
    sentences = ["Ein Mann mit einem orangefarbenen Hut.", "Zwei 漢字 Hunde ☃ spielen."]
    sampler = SegmentationSampler(subwords, sentences, alpha=0.5)
    protos = subwords.processor.nbest_encode(sentences, nbest_size=16, return_type="proto")
    offsets = []
    for index, proto in enumerate(protos):
        ours = sampler.scores[sampler.first[index]:sampler.first[index + 1]]
        assert [list(ids) for ids in sampler.candidates(index)] == [
            [piece.id for piece in best.pieces] for best in proto.nbests]
        offsets.append(np.array([best.score for best in proto.nbests]) - ours)
        np.testing.assert_allclose(offsets[-1], offsets[-1][0], atol=1e-3)
    assert abs(offsets[0][0]) < 1e-3 and offsets[1][0] < -20  # three unknown characters


@pytest.mark.tensorflow_only("the Corpus builds tf.data batches")
def test_corpus_draws_each_epochs_segmentations_and_keeps_the_best_without_alpha(tmp_path):
    from kyu_transformer.data.corpus import Corpus

    def lists(columns):
        return [lists_of(column) for column in columns]

    def pairs_and_longest(corpus):
        rows = [(len(labels), features["source"].shape[1], labels.shape[1])
                for features, labels in corpus.train_batches(0)]
        return sum(row[0] for row in rows), max(row[1] for row in rows), max(row[2] for row in rows)

    plain = Corpus(MULTI30K, str(tmp_path), hp.parse("tiny"), log=lambda line: None)
    best = lists(plain.train_columns(0))
    assert lists(plain.train_columns(3)) == best
    lines = []
    sampled = Corpus(MULTI30K, str(tmp_path), hp.parse("tiny", {"subword_alpha": "0.5"}),
                     log=lines.append)
    assert "subword regularization: alpha 0.5" in lines[-1]
    first, again, second = (lists(sampled.train_columns(e)) for e in (0, 0, 1))
    assert first == again and first != second and first != best
    # each pair is a source and its own target
    sources, targets, _ = load_split(MULTI30K, "train")
    decode = sampled.subwords.decode
    assert [(decode(source), decode(target)) for source, target in zip(*first)] == list(
        zip(sources, targets))
    # the length limit holds for the drawn segmentations, which are longer than the best
    limits = {"maxlen1": "20", "maxlen2": "20"}
    short = Corpus(MULTI30K, str(tmp_path), hp.parse("tiny", {"subword_alpha": "0.1", **limits}),
                   log=lambda line: None)
    short_best = Corpus(MULTI30K, str(tmp_path), hp.parse("tiny", limits), log=lambda line: None)
    drawn_pairs, longest_source, longest_target = pairs_and_longest(short)
    assert drawn_pairs < pairs_and_longest(short_best)[0]  # more pairs dropped than with the best
    assert longest_source <= 20 and longest_target <= 20
    reseeded = Corpus(MULTI30K, str(tmp_path), hp.parse("tiny", {"subword_alpha": "0.5",
                                                                 "seed": "7"}),
                      log=lambda line: None)
    assert lists(reseeded.train_columns(0)) != first
