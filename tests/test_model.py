"""The Transformer model: shapes, masks, tied weights, saving."""

import keras
import numpy as np
import pytest

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


def test_logits_use_the_tied_embedding(batch):
    model = Transformer(**SIZE)
    memory, source_mask = model.encode(batch["source"])
    logits = np.asarray(model.decode(batch["target_in"], memory, source_mask))
    model.target_embedding.embeddings.assign(np.asarray(model.target_embedding.embeddings) * 2)
    memory, source_mask = model.encode(batch["source"])
    assert not np.allclose(model.decode(batch["target_in"], memory, source_mask), logits)


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


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_save_and_load_identical_outputs(tmp_path, batch, norm_position):
    model = Transformer(**SIZE, norm_position=norm_position, share_embeddings=False)
    logits = model(batch)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(loaded(batch), logits)
    assert loaded.get_config()["norm_position"] == norm_position


def test_dropout_only_in_training(batch):
    model = Transformer(**SIZE)
    np.testing.assert_array_equal(model(batch), model(batch, training=False))
    assert not np.allclose(model(batch, training=True), model(batch))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        Transformer(**{**SIZE, "num_heads": 3})
