"""The Transformer model: shapes, masks, tied weights, saving."""

import inspect

import keras
import numpy as np
import pytest

from kyu_transformer import config
from kyu_transformer.conventions import LAYER_NORM_EPSILON
from kyu_transformer.layers import Embedding, Normalize, ScaleNorm
from kyu_transformer.model import Transformer

SIZE = dict(vocab_size=60, d_model=16, d_ff=32, num_blocks=2, num_heads=2, maxlen1=20,
            maxlen2=20, dropout_rate=0.1)


@pytest.fixture
def batch(rng):
    source = rng.integers(4, 60, size=(3, 9))
    source[1, 6:] = 0
    target = rng.integers(4, 60, size=(3, 7))
    target[2, 4:] = 0
    return {"source": source, "target_in": target}


def test_logits_shape_and_encode_decode_are_the_call(batch):
    model = Transformer(**SIZE)
    logits = model(batch)
    assert logits.shape == (3, 7, 60)
    memory, source_mask = model.encode(batch["source"])
    np.testing.assert_array_equal(source_mask, batch["source"] != 0)
    np.testing.assert_allclose(model.decode(batch["target_in"], memory, source_mask), logits,
                               atol=1e-6)


def test_shared_table_by_default_and_separate_as_an_option(batch):
    shared = Transformer(**SIZE)
    shared.build()
    separate = Transformer(**SIZE, share_embeddings=False)
    separate.build()
    assert shared.source_embedding is shared.target_embedding
    assert separate.source_embedding is not separate.target_embedding
    assert separate.count_params() - shared.count_params() == 60 * 16


class SeparateOutputEmbedding(Embedding):
    """An embedding whose logits come from a second table: an untied output projection."""

    def build(self, input_shape=None):
        super().build(input_shape)
        self.output_table = self.add_weight(
            name="output_table", shape=(self.vocab_size, self.num_units),
            initializer="glorot_uniform")

    def attend(self, inputs, table=None):
        return keras.ops.matmul(inputs, keras.ops.transpose(self.output_table))


def decoder_states(model, batch):
    """What the output projection receives: the decoder stack's output `(N, T, C)`."""
    memory, source_mask = model.encode(batch["source"])
    target = batch["target_in"]
    x = model.target_embedding(target) + model.target_positions(target)
    for block in model.decoder_blocks:
        x = block(x, memory, mask=target != 0, memory_mask=source_mask)
    if model.norm_position == "pre":
        x = model.decoder_norm(x)
    return np.asarray(x)


def logits_project_onto(model, batch, table):
    """Whether the model's logits are its decoder states times `table`^T (no scale)."""
    logits = np.asarray(model(batch))
    return np.allclose(logits, decoder_states(model, batch) @ np.asarray(table).T,
                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_logits_use_the_shared_embedding_table(batch, norm_position):
    model = Transformer(**SIZE, norm_position=norm_position)
    model.build()
    table = model.target_embedding.embeddings
    assert model.source_embedding.embeddings is table  # one table embeds both sides
    assert logits_project_onto(model, batch, table)


def test_separate_source_table_leaves_the_output_tied_to_the_target_table(batch):
    model = Transformer(**SIZE, share_embeddings=False)
    model.build()
    assert logits_project_onto(model, batch, model.target_embedding.embeddings)
    assert not logits_project_onto(model, batch, model.source_embedding.embeddings)


def test_the_tied_weight_check_fails_for_an_untied_model(batch):
    # The control: a model whose output projection has its own table.
    model = Transformer(**SIZE)
    model.target_embedding = model.source_embedding = SeparateOutputEmbedding(
        60, 16, name="untied_embedding")
    model.build()
    assert not logits_project_onto(model, batch, model.target_embedding.embeddings)
    assert logits_project_onto(model, batch, model.target_embedding.output_table)


def test_future_targets_and_source_padding_do_not_leak(batch):
    model = Transformer(**SIZE)
    logits = np.asarray(model(batch))
    changed = {k: v.copy() for k, v in batch.items()}
    changed["target_in"][:, 5:] = 7
    changed["source"][1, 6:] = 0  # still padding
    np.testing.assert_allclose(np.asarray(model(changed))[:, :5], logits[:, :5], atol=1e-5)
    longer = {"source": np.pad(batch["source"], [[0, 0], [0, 4]]),
              "target_in": batch["target_in"]}
    np.testing.assert_allclose(model(longer), logits, atol=1e-5)


@pytest.mark.parametrize("norm_position, norm_type, fix_norm", [
    ("post", "layer", False), ("pre", "layer", False), ("pre", "scale", True)])
def test_save_and_load_identical_outputs(tmp_path, batch, norm_position, norm_type, fix_norm):
    model = Transformer(**SIZE, norm_position=norm_position, share_embeddings=False,
                        norm_type=norm_type, fix_norm=fix_norm)
    model.build()
    for gain in (weight for weight in model.weights if weight.path.endswith("/gain")):
        gain.assign(gain * 0.9)  # not the initial value, which a fresh layer would also have
    logits = model(batch)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(loaded(batch), logits)
    assert {key: loaded.get_config()[key] for key in ("norm_position", "norm_type", "fix_norm")} \
        == {"norm_position": norm_position, "norm_type": norm_type, "fix_norm": fix_norm}


def test_scale_norm_and_fix_norm_reach_every_norm_and_the_logits(batch):
    """Pre-norm with ScaleNorm and FixNorm ("Transformers without Tears"): every norm is a
    ScaleNorm, and the logits are the final states times unit rows (the final gain times
    cosines), not times the table as stored."""
    model = Transformer(**SIZE, norm_position="pre", norm_type="scale", fix_norm=True)
    model.build()
    norms = [layer for layer in model._flatten_layers() if isinstance(layer, (Normalize,
                                                                              ScaleNorm))]
    assert len(norms) == 2 * SIZE["num_blocks"] + 3 * SIZE["num_blocks"] + 2
    assert all(isinstance(norm, ScaleNorm) for norm in norms)
    table = np.asarray(model.target_embedding.embeddings)
    lengths = np.linalg.norm(table, axis=-1, keepdims=True)
    units = np.divide(table, lengths, out=np.zeros_like(table), where=lengths > 0)
    assert logits_project_onto(model, batch, units)
    assert not logits_project_onto(model, batch, table)


def test_embedding_init_normal_starts_each_table_at_unit_variance_once_scaled(batch):
    """``embedding_init="normal"``: every row but padding drawn with standard deviation
    1/sqrt(C), so that the looked-up (scaled) embeddings start at standard deviation 1, each
    table its own draws; the default keeps Glorot uniform's smaller rows; saved and loaded."""
    size = {**SIZE, "vocab_size": 2000, "d_model": 64, "num_heads": 4}
    model = Transformer(**size, embedding_init="normal", share_embeddings=False)
    model.build()
    tables = [np.asarray(layer.embeddings) for layer in (model.source_embedding,
                                                         model.target_embedding)]
    for table in tables:
        np.testing.assert_array_equal(table[0], 0.0)  # padding
        assert abs(table[1:].std() / (1 / 8.0) - 1) < 0.02  # 1/sqrt(64), over 127,936 draws
        assert abs(table[1:].mean()) < 0.002
    assert not np.allclose(tables[0], tables[1])
    ids = np.arange(1, 2000).reshape(1, -1)
    assert abs(np.asarray(model.source_embedding(ids)).std() - 1.0) < 0.02
    glorot = Transformer(**size)
    glorot.build()
    limit = np.sqrt(6.0 / (2000 + 64))  # Glorot uniform's bound: a std of limit/sqrt(3)
    assert np.abs(np.asarray(glorot.target_embedding.embeddings)).max() <= limit
    assert glorot.get_config()["embedding_init"] == "glorot"
    restored = Transformer.from_config(model.get_config())
    assert restored.embedding_init == "normal"
    with pytest.raises(ValueError, match="`embedding_init` must be one of glorot, normal, "
                                         "got 'uniform'"):
        Transformer(**SIZE, embedding_init="uniform")


def test_from_hparams_takes_every_model_argument():
    model = Transformer.from_hparams({**config.DEFAULTS, **SIZE, "fast_paths": False,
                                      "epsilon": 1e-5})
    assert model.epsilon == 1e-5 and model.get_config()["epsilon"] == 1e-5
    model.build()  # the fast-paths hparam is the switch the model's layers were made with
    assert not any(layer.fast_paths for layer in model._flatten_layers()
                   if hasattr(layer, "fast_paths"))
    arguments = set(inspect.signature(Transformer).parameters) - {"kwargs"}
    assert arguments | {"fast_paths"} <= set(config.DEFAULTS)  # every one is an hparam
    assert set(model.get_config()) >= arguments


def test_attention_dropout_none_is_the_dropout_rate_and_hparams_spell_it_minus_one():
    assert Transformer(**SIZE).attention_dropout == SIZE["dropout_rate"]
    assert Transformer(**SIZE, attention_dropout=0.3).attention_dropout == 0.3
    from_hparams = Transformer.from_hparams({**SIZE, "dropout_rate": 0.2,
                                             "attention_dropout": -1.0})
    assert from_hparams.attention_dropout == 0.2
    with pytest.raises(ValueError, match="`attention_dropout` must be in"):
        Transformer(**SIZE, attention_dropout=-1)


def test_one_layer_norm_epsilon_in_layers_model_and_hparams():

    model = Transformer(**SIZE)
    model.build()
    epsilons = {layer.epsilon for layer in model._flatten_layers() if isinstance(layer, Normalize)}
    assert epsilons == {LAYER_NORM_EPSILON} == {model.epsilon} == {config.DEFAULTS["epsilon"]}


def test_dropout_only_in_training(batch):
    model = Transformer(**SIZE)
    np.testing.assert_array_equal(model(batch), model(batch, training=False))
    assert not np.allclose(model(batch, training=True), model(batch))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        Transformer(**{**SIZE, "num_heads": 3})
    with pytest.raises(ValueError, match="`num_heads` must be positive"):
        Transformer(**{**SIZE, "num_heads": 0})


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_only_pre_norm_stacks_end_with_a_norm(norm_position):
    model = Transformer(**SIZE, norm_position=norm_position)
    norms = (model.encoder_norm, model.decoder_norm)
    assert all(isinstance(norm, Normalize) if norm_position == "pre" else norm is None
               for norm in norms)
