"""What the training benchmarks share, without TensorFlow: keras-hub's model at our model's size,
and the matrix-multiply FLOPs of a training step."""

import keras


def keras_hub_model(shape, sequence_length, dropout_rate):
    """keras-hub's encoder-decoder of `shape` (``vocab_size``, ``d_model``, ``d_ff``,
    ``num_blocks``, ``num_heads``), taking ``{"source", "target_in"}`` ids and returning logits.

    Built from its `TokenAndPositionEmbedding`, `TransformerEncoder` and `TransformerDecoder`
    (position tables of `sequence_length`) and a `Dense` output layer.
    """
    import keras_hub  # pylint: disable=import-outside-toplevel

    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target_in")
    embed = dict(vocabulary_size=shape["vocab_size"], sequence_length=sequence_length,
                 embedding_dim=shape["d_model"])
    x = keras_hub.layers.TokenAndPositionEmbedding(**embed)(source)
    for _ in range(shape["num_blocks"]):
        x = keras_hub.layers.TransformerEncoder(shape["d_ff"], shape["num_heads"],
                                                dropout=dropout_rate)(x)
    y = keras_hub.layers.TokenAndPositionEmbedding(**embed)(target)
    for _ in range(shape["num_blocks"]):
        y = keras_hub.layers.TransformerDecoder(shape["d_ff"], shape["num_heads"],
                                                dropout=dropout_rate)(y, x)
    logits = keras.layers.Dense(shape["vocab_size"])(y)
    return keras.Model({"source": source, "target_in": target}, logits, name="keras_hub")


def training_flops(shape, batch, source_len, target_len):
    """Matrix-multiply FLOPs of one training step of a model of `shape` on `batch` pairs
    (forward x 3: the backward pass multiplies twice as much), analytic.

    Counted: every projection and feed-forward product, attention's ``QK^T`` and ``AV`` (the
    decoder's over the whole target, as a masked product still computes it), and the output
    layer; not the embedding look-ups, norms or softmaxes.
    """
    d, d_ff, v, s, t = (shape["d_model"], shape["d_ff"], shape["vocab_size"], source_len,
                        target_len)
    encoder_token = 8 * d * d + 4 * d * d_ff + 4 * s * d
    decoder_token = (8 * d * d + 4 * t * d) + (4 * d * d + 4 * s * d) + 4 * d * d_ff
    cross_kv_per_source_token = 4 * d * d
    forward = batch * (shape["num_blocks"] * (s * encoder_token + t * decoder_token
                                              + s * cross_kv_per_source_token)
                       + t * 2 * d * v)
    return 3 * forward
