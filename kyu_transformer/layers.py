"""The Transformer building blocks, as Keras 3 layers.

Each layer here is one graph builder of the 2017 TensorFlow 1.x ``modules.py``
rewritten as a Keras layer, in the original's order: ``normalize``
(`Normalize`), ``embedding`` (`Embedding`), ``positional_encoding``
(`PositionalEncoding`), ``multihead_attention`` (`MultiHeadAttention`, over
`ScaledDotProductAttention`), ``feedforward`` (`FeedForward`) and
``label_smoothing``; then the encoder and decoder blocks made of them, and the
`Dropout` they all use.

Shapes in the comments use: ``N`` batch, ``T_q``/``T_k`` query/key time steps,
``C`` model width (``num_units``), ``h`` heads, ``d_k`` width of one head,
``V`` vocabulary size.

Masks follow the Keras convention: a boolean tensor, ``True`` = keep. Every
layer takes its masks either as explicit arguments or from the Keras mask that
an upstream layer (e.g. ``Embedding``) attached to its input.

Where the original was wrong, the default here is the corrected behaviour and
the original is reachable through an explicit option:

- the sinusoid exponent is ``2*floor(i/2)/d`` (the original used ``2*i/d``);
- padding is told by token id 0 / the Keras mask, not by all-zero vectors
  (which stop being zero once positional encodings are added);
- Q/K/V projections are linear (``projection_activation="relu"`` restores the
  original's ReLU);
- the masking constant fits float16 and bfloat16, and a query that may see no
  key gets all-zero weights instead of NaN.

`Normalize` and `Dropout` compute what Keras' ``LayerNormalization`` and
``Dropout`` compute. With ``fast_paths=True`` (the default, passed down by
every layer that creates them) they do it by the CPU fast paths of
`kyu_transformer.fast_paths`; with ``fast_paths=False`` they are Keras' own.
"""

import math

import keras
import numpy as np
from keras import ops

from kyu_transformer import fast_paths as fast

NORM_POSITIONS = ("post", "pre")
ENCODING_STYLES = ("interleaved", "concat")

# The layer-norm epsilon of the layers, the model and hparams.py: one value,
# so that a layer built alone normalizes as the same layer inside a model
# trained with the default hyperparameters. 1e-6 (OpenNMT-tf's and tensor2tensor's)
# rather than the original's 1e-8: the statistics are computed in float32, where
# both are negligible next to the activations' variance, and 1e-6 was already
# the value every model here was trained with. Trained models keep the epsilon
# stored in their config and hparams.json.
LAYER_NORM_EPSILON = 1e-6

# Score given to masked positions before the softmax. Finite and representable
# in every float dtype (the original's -2**32+1 overflows float16 to -inf, and
# -inf turns a fully masked row into NaN).
_MASKED_SCORE = {"float16": -3.0e4}
_MASKED_SCORE_DEFAULT = -1.0e9


# Keras' own accessors of the mask it attaches to a tensor. Tensors that cannot
# hold a Python attribute (JAX tracers under `jax.jit`, numpy arrays) keep
# their mask in a table of Keras' that only these functions read, so reading
# the `_keras_mask` attribute directly would silently lose the mask there.
# Keras 3.15 exports them from `keras.src.backend` only; the public path is
# used when a Keras version provides it.
_get_keras_mask = getattr(keras.backend, "get_keras_mask", None)
if _get_keras_mask is None:
    from keras.src.backend import get_keras_mask as _get_keras_mask


def _keras_mask(tensor):
    """The Keras mask attached to ``tensor`` by an upstream layer, or None."""
    return _get_keras_mask(tensor)


def _masked_score(dtype):
    return _MASKED_SCORE.get(keras.backend.standardize_dtype(dtype), _MASKED_SCORE_DEFAULT)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def _check_rate(name, value):
    if not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")


def causal_mask(num_queries, num_keys):
    """Boolean ``(T_q, T_k)`` mask: query ``i`` may see key ``j`` iff ``j <= i``."""
    query_positions = ops.arange(num_queries)[:, None]  # (T_q, 1)
    key_positions = ops.arange(num_keys)[None, :]  # (1, T_k)
    return ops.greater_equal(query_positions, key_positions)  # (T_q, T_k)


# ------------------------------------------------------------------- normalize


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Normalize(keras.layers.LayerNormalization):
    """Layer normalization over the last axis (the original ``normalize``).

    ``gamma * (x - mean) / sqrt(var + epsilon) + beta`` with the biased
    variance, computed in float32 under mixed precision, as Keras'
    ``LayerNormalization``, whose weights, options and saved form this layer
    keeps.

    Args:
      epsilon: Small number added to the variance.
      fast_paths: If True, over the last axis, `fast_paths.layer_norm` (a
        stated gradient); if False, Keras' ``LayerNormalization.call``.

    Call arguments:
      inputs: A tensor `(..., C)`.

    Returns:
      A tensor of the same shape; weights `gamma` (ones) and `beta` (zeros) of
      shape `(C,)`.
    """

    def __init__(self, epsilon=LAYER_NORM_EPSILON, fast_paths=True, **kwargs):
        kwargs.setdefault("axis", -1)
        super().__init__(epsilon=epsilon, **kwargs)
        self.fast_paths = bool(fast_paths)

    def call(self, inputs):
        if self.fast_paths and self._is_plain_last_axis_norm(inputs):
            return fast.layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return super().call(inputs)

    def _is_plain_last_axis_norm(self, inputs):
        """Whether the fast path computes this layer: last axis, gamma and beta, no RMS."""
        last = len(inputs.shape) - 1
        return (self.axis in (-1, [-1], last, [last]) and self.center and self.scale
                and not self.rms_scaling)

    def get_config(self):
        return {**super().get_config(), "fast_paths": self.fast_paths}


# ------------------------------------------------------------------- embedding


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Embedding(keras.layers.Layer):
    """Token embedding with a zero padding row and sqrt(C) scaling.

    Args:
      vocab_size: Number of ids.
      num_units: Width `C` of an embedding.
      zero_pad: If True, id 0 (padding) always embeds to exact zeros, whatever
        the optimizer does to the table.
      scale: If True, outputs are multiplied by ``sqrt(num_units)``.
      embeddings_initializer: Initializer of the table (Glorot uniform, as the
        original's Xavier).

    Call arguments:
      inputs: Integer ids `(N, T)`.

    Returns:
      `(N, T, C)` embeddings, with the Keras mask ``ids != 0`` attached.
      `attend(x)` maps `(..., C)` back to `(..., V)` logits with the same table.
    """

    def __init__(self, vocab_size, num_units, zero_pad=True, scale=True,
                 embeddings_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if vocab_size < 1 or num_units < 1:
            raise ValueError(
                f"`vocab_size` and `num_units` must be positive, got {vocab_size} and {num_units}.")
        self.vocab_size = int(vocab_size)
        self.num_units = int(num_units)
        self.zero_pad = bool(zero_pad)
        self.scale = bool(scale)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.supports_masking = True

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.vocab_size, self.num_units),
            initializer=self._initial_table)
        # (V, 1): 0 for the padding row, 1 elsewhere.
        keep_rows = np.ones((self.vocab_size, 1), dtype="float32")
        if self.zero_pad:
            keep_rows[0] = 0.0
        self._keep_rows = keep_rows

    def _initial_table(self, shape, dtype=None):
        table = self.embeddings_initializer(shape, dtype=dtype)
        if self.zero_pad:
            # Start the padding row at zero, so that `embeddings` itself shows it.
            table = ops.concatenate([ops.zeros((1, shape[1]), dtype=dtype), table[1:]], axis=0)
        return table

    def table(self):
        """The lookup table in the compute dtype, its padding row forced to zero."""
        if not self.built:
            self.build()
        table = ops.cast(self.embeddings, self.compute_dtype)  # (V, C)
        if self.zero_pad:
            # Multiplying (not only initializing) keeps row 0 at zero and its
            # gradient at zero, whatever the optimizer or weight decay does.
            table = table * ops.cast(self._keep_rows, self.compute_dtype)
        return table

    def call(self, inputs, table=None):
        """`table`: optional, the result of `table()` (decoding loops compute it once)."""
        ids = ops.cast(inputs, "int32")
        table = self.table() if table is None else table
        outputs = ops.take(table, ids, axis=0)  # (N, T, C)
        if self.scale:
            outputs = outputs * ops.cast(math.sqrt(self.num_units), self.compute_dtype)
        return outputs

    def attend(self, inputs, table=None):
        """Logits ``inputs @ embeddings^T`` `(..., V)`, for tied output weights."""
        table = self.table() if table is None else table
        return ops.matmul(inputs, ops.transpose(table))  # (..., V)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)  # (N, T)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.num_units,)

    def get_config(self):
        config = super().get_config()
        config.update(
            vocab_size=self.vocab_size, num_units=self.num_units, zero_pad=self.zero_pad,
            scale=self.scale,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer))
        return config


# --------------------------------------------------------- positional encoding


def sinusoid_table(maxlen, num_units, style="interleaved"):
    """The `(maxlen, num_units)` sinusoid encodings, as a float32 numpy array.

    ``interleaved`` (the paper): column ``i`` holds ``sin`` (even ``i``) or
    ``cos`` (odd ``i``) of ``pos / 10000^(2*floor(i/2)/num_units)``.
    ``concat`` (tensor2tensor): all sines, then all cosines, over
    ``num_units // 2`` geometrically spaced timescales (a zero column is
    appended when ``num_units`` is odd).
    """
    _check_choice("style", style, ENCODING_STYLES)
    positions = np.arange(maxlen, dtype=np.float64)[:, None]  # (maxlen, 1)
    if style == "interleaved":
        pair_index = np.arange(num_units) // 2  # floor(i/2)
        angles = positions / np.power(10000.0, 2.0 * pair_index / num_units)  # (maxlen, C)
        table = np.where(np.arange(num_units) % 2 == 0, np.sin(angles), np.cos(angles))
    else:
        num_timescales = num_units // 2
        log_increment = math.log(10000.0) / max(num_timescales - 1, 1)
        inv_timescales = np.exp(-log_increment * np.arange(num_timescales))  # (C/2,)
        scaled_time = positions * inv_timescales[None, :]  # (maxlen, C/2)
        table = np.concatenate([np.sin(scaled_time), np.cos(scaled_time)], axis=1)
        table = np.pad(table, [[0, 0], [0, num_units % 2]])
    return table.astype("float32")


@keras.saving.register_keras_serializable(package="kyu_transformer")
class PositionalEncoding(keras.layers.Layer):
    """Position encodings, sinusoidal or learned (the original ``positional_encoding``).

    The layer returns the encodings; the caller adds them to the embeddings.

    Args:
      maxlen: Longest sequence the layer accepts.
      num_units: Width `C`; when None, taken from the last axis of 3-D inputs.
      sinusoid: If True, fixed sinusoids (not trainable); else a learned
        `(maxlen, C)` table.
      style: ``"interleaved"`` (sin in even columns, cos in odd ones) or
        ``"concat"`` (sines then cosines, as tensor2tensor).
      zero_pad: If True, the encoding of position 0 is zero (the original's
        meaning; padding tokens are handled by `masking`).
      scale: If True, encodings are multiplied by ``sqrt(C)``.
      masking: If True, encodings at padding positions (id 0, or Keras mask
        False) are zero.

    Call arguments:
      inputs: Ids `(N, T)` or embeddings `(N, T, C)`.
      mask: Optional boolean `(N, T)`; by default the Keras mask of `inputs`,
        or ``ids != 0`` for ids.

    Returns:
      `(N, T, C)` encodings. Raises ValueError when ``T > maxlen``.
    """

    def __init__(self, maxlen, num_units=None, sinusoid=True, style="interleaved",
                 zero_pad=False, scale=False, masking=True, **kwargs):
        super().__init__(**kwargs)
        _check_choice("style", style, ENCODING_STYLES)
        if maxlen < 1:
            raise ValueError(f"`maxlen` must be positive, got {maxlen}.")
        self.maxlen = int(maxlen)
        self.num_units = None if num_units is None else int(num_units)
        self.sinusoid = bool(sinusoid)
        self.style = style
        self.zero_pad = bool(zero_pad)
        self.scale = bool(scale)
        self.masking = bool(masking)
        self.supports_masking = True

    def build(self, input_shape):
        num_units = self.num_units
        if num_units is None:
            if len(input_shape) != 3 or input_shape[-1] is None:
                raise ValueError(
                    "PositionalEncoding needs `num_units` when its inputs are ids; "
                    f"got inputs of shape {input_shape}.")
            num_units = input_shape[-1]
        self._units = num_units
        if self.sinusoid:
            self._sinusoids = sinusoid_table(self.maxlen, num_units, self.style)
        else:
            self.position_embeddings = self.add_weight(
                name="position_embeddings", shape=(self.maxlen, num_units),
                initializer="glorot_uniform")
        # (maxlen, 1): 0 for position 0 when zero_pad.
        keep_rows = np.ones((self.maxlen, 1), dtype="float32")
        if self.zero_pad:
            keep_rows[0] = 0.0
        self._keep_rows = keep_rows

    def _table(self, length):
        table = self._sinusoids if self.sinusoid else self.position_embeddings
        table = ops.cast(table, self.compute_dtype)[:length]  # (T, C)
        return self._finished(table, self._keep_rows[:length] if self.zero_pad else None)

    def _finished(self, rows, keep_rows):
        """Rows of the table (in the compute dtype), padding zeroed and scaled as configured.

        `keep_rows`: the rows' `_keep_rows` (read with `zero_pad` only).
        """
        if self.zero_pad:
            rows = rows * ops.cast(keep_rows, self.compute_dtype)
        if self.scale:
            rows = rows * ops.cast(math.sqrt(self._units), self.compute_dtype)
        return rows

    def encoding_at(self, position):
        """The `(1, C)` encoding of one position (for step-by-step decoding).

        Only that row is read and finished, not the whole table.
        """
        table = self._sinusoids if self.sinusoid else self.position_embeddings
        index = ops.reshape(ops.cast(position, "int32"), (1,))
        keep_rows = ops.take(self._keep_rows, index, axis=0) if self.zero_pad else None
        return self._finished(ops.cast(ops.take(table, index, axis=0), self.compute_dtype),
                              keep_rows)

    def call(self, inputs, mask=None):
        length = inputs.shape[1]
        if length is not None and length > self.maxlen:
            raise ValueError(
                f"PositionalEncoding got a sequence of length {length}, longer than "
                f"maxlen={self.maxlen}.")
        if length is None:
            length = ops.shape(inputs)[1]
        encodings = self._table(length)[None]  # (1, T, C)
        encodings = ops.broadcast_to(encodings, (ops.shape(inputs)[0], length, self._units))
        position_mask = self.compute_mask(inputs, mask)
        if self.masking and position_mask is not None:
            encodings = encodings * ops.cast(position_mask, self.compute_dtype)[..., None]
        return encodings  # (N, T, C)

    def compute_mask(self, inputs, mask=None):
        if mask is None:
            mask = _keras_mask(inputs)
        if mask is None and len(inputs.shape) == 2:
            mask = ops.not_equal(inputs, 0)  # (N, T), from ids
        return mask

    def compute_output_shape(self, input_shape):
        units = self.num_units or input_shape[-1]
        return (input_shape[0], input_shape[1], units)

    def get_config(self):
        config = super().get_config()
        config.update(
            maxlen=self.maxlen, num_units=self.num_units, sinusoid=self.sinusoid,
            style=self.style, zero_pad=self.zero_pad, scale=self.scale, masking=self.masking)
        return config


# --------------------------------------------------------- multihead attention


@keras.saving.register_keras_serializable(package="kyu_transformer")
class ScaledDotProductAttention(keras.layers.Layer):
    """``softmax(Q K^T / temperature) V`` over heads, the default attention operator.

    Any layer or callable with the same call signature can replace it in
    `MultiHeadAttention(attention=...)`.

    Args:
      dropout_rate: Dropout on the attention weights, in training only.
      temperature: Divisor of the scores; ``sqrt(d_k)`` when None.
      fast_paths: Passed to its `Dropout`.

    Call arguments:
      q: `(N, h, T_q, d_k)`; k: `(N, h, T_k, d_k)`; v: `(N, h, T_k, d_v)`.
      mask: Optional boolean, broadcastable to `(N, h, T_q, T_k)`; False hides
        a key from a query. A query that sees no key gets all-zero weights.

    Returns:
      ``(outputs, weights)``: `(N, h, T_q, d_v)` and the weights before dropout
      `(N, h, T_q, T_k)`.
    """

    def __init__(self, dropout_rate=0.0, temperature=None, fast_paths=True, **kwargs):
        super().__init__(**kwargs)
        _check_rate("dropout_rate", dropout_rate)
        self.dropout_rate = float(dropout_rate)
        self.temperature = temperature
        self.fast_paths = bool(fast_paths)
        self.dropout = Dropout(self.dropout_rate, fast_paths=self.fast_paths)

    def call(self, q, k, v, mask=None, training=None):
        temperature = self.temperature or math.sqrt(q.shape[-1])
        # Scaled after the product: the scores are smaller than the queries
        # when T_k < d_k, and oneDNN fuses the product, the scaling and the
        # mask's addition into one kernel.
        scores = ops.matmul(q, ops.swapaxes(k, -1, -2))  # (N, h, T_q, T_k)
        scores = scores * ops.cast(1.0 / temperature, scores.dtype)
        if mask is not None:
            # Hidden keys get a large negative score, added rather than
            # selected: the bias is built at the mask's size (no head axis)
            # and an addition passes its gradient through unchanged.
            hidden_score = ops.cast(_masked_score(scores.dtype), scores.dtype)
            # bias: (N|1, 1, T_q|1, T_k)
            bias = ops.where(mask, ops.zeros_like(hidden_score), hidden_score)
            scores = scores + bias
        weights = ops.softmax(scores, axis=-1)  # (N, h, T_q, T_k)
        if mask is not None:
            # A query that sees no key came out uniform: make its row exactly zero.
            sees_a_key = ops.any(mask, axis=-1, keepdims=True)  # (N|1, 1, T_q|1, 1)
            weights = weights * ops.cast(sees_a_key, weights.dtype)
        outputs = ops.matmul(self.dropout(weights, training=training), v)  # (N, h, T_q, d_v)
        return outputs, weights

    def get_config(self):
        config = super().get_config()
        config.update(dropout_rate=self.dropout_rate, temperature=self.temperature,
                      fast_paths=self.fast_paths)
        return config


@keras.saving.register_keras_serializable(package="kyu_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with residual connection and normalization.

    The original ``multihead_attention``: project queries/keys/values, split
    the projections into `num_heads` heads along the last axis (head ``h``
    owns columns ``h*d_k:(h+1)*d_k``), attend, concatenate the heads, add the
    queries back and normalize. `sublayer` is the attention alone; `call`
    wraps it as the paper wraps every sub-layer: dropout, residual sum, norm.

    Args:
      num_heads: Number of heads `h`; must divide `num_units`.
      num_units: Attention width `C`; the queries' width when None.
      dropout_rate: Dropout on the attention weights (training only).
      causality: If True, query ``i`` never sees key ``j > i``.
      use_bias: Whether the projections have biases.
      projection_activation: Activation of the Q/K/V projections; ``"relu"``
        reproduces the original.
      output_projection: If True, a final `Dense` (`output_dense`) maps the
        concatenated heads back to the queries' width.
      norm_position: ``"post"``: ``LN(q + Attn(q, k, v))`` (the original);
        ``"pre"``: ``q + Attn(LN(q), k, v)``, where self-attention also uses
        the normalized queries as keys and values.
      epsilon: Epsilon of the `Normalize` layer (`norm`).
      residual_dropout_rate: Dropout on the attention output before the
        residual sum (training only); 0 as the original.
      attention: The attention operator, a layer or callable
        ``(q, k, v, mask) -> (outputs, weights)`` on per-head tensors;
        `ScaledDotProductAttention(dropout_rate)` when None.
      fast_paths: Passed to its `Normalize` and `Dropout` layers.

    Call arguments:
      queries: `(N, T_q, C_q)`.
      keys: `(N, T_k, C_k)`; None (or `queries` itself) for self-attention.
      values: `(N, T_k, C_v)`; `keys` when None. Values of their own are
        always used, also when the keys are the queries.
      query_mask: Optional boolean `(N, T_q)`; default the Keras mask of
        `queries`. A masked query gets all-zero attention weights.
      key_mask: Optional boolean `(N, T_k)`; default the Keras mask of `keys`
        (of `queries` in self-attention). A masked key gets weight 0.
      training: Whether dropout is active.
      return_attention_scores: If True, also return the weights.

    Returns:
      `(N, T_q, C_q)` outputs, or ``(outputs, weights)`` with weights
      `(N, h, T_q, T_k)`.
    """

    def __init__(self, num_heads=8, num_units=None, dropout_rate=0.0, causality=False,
                 use_bias=True, projection_activation=None, output_projection=False,
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, residual_dropout_rate=0.0,
                 attention=None, fast_paths=True, **kwargs):
        super().__init__(**kwargs)
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rate("dropout_rate", dropout_rate)
        _check_rate("residual_dropout_rate", residual_dropout_rate)
        if num_heads < 1:
            raise ValueError(f"`num_heads` must be positive, got {num_heads}.")
        if num_units is not None and num_units % num_heads:
            raise ValueError(
                f"`num_units` ({num_units}) must be divisible by `num_heads` ({num_heads}).")
        self.num_heads = int(num_heads)
        self.num_units = None if num_units is None else int(num_units)
        self.dropout_rate = float(dropout_rate)
        self.causality = bool(causality)
        self.use_bias = bool(use_bias)
        self.projection_activation = keras.activations.get(projection_activation)
        self.output_projection = bool(output_projection)
        self.norm_position = norm_position
        self.epsilon = float(epsilon)
        self.residual_dropout_rate = float(residual_dropout_rate)
        self.fast_paths = bool(fast_paths)
        if isinstance(attention, dict):
            attention = keras.saving.deserialize_keras_object(attention)
        self.attention = attention or ScaledDotProductAttention(self.dropout_rate,
                                                                fast_paths=self.fast_paths)
        self.residual_dropout = Dropout(self.residual_dropout_rate, fast_paths=self.fast_paths)
        self.norm = Normalize(epsilon=self.epsilon, fast_paths=self.fast_paths, name="norm")
        self.supports_masking = True

    def build(self, queries_shape, keys_shape=None, values_shape=None):
        keys_shape = keys_shape or queries_shape
        values_shape = values_shape or keys_shape
        query_width = queries_shape[-1]
        units = self.num_units or query_width
        if units % self.num_heads:
            raise ValueError(
                f"The attention width ({units}) must be divisible by `num_heads` "
                f"({self.num_heads}).")
        if units != query_width and not self.output_projection:
            raise ValueError(
                f"`num_units` ({units}) differs from the queries' width ({query_width}): "
                "the residual connection needs `output_projection=True`.")
        self._units = units

        def projection(name):
            return keras.layers.Dense(units, activation=self.projection_activation,
                                      use_bias=self.use_bias, name=name)

        self.query_dense = projection("query_dense")
        self.key_dense = projection("key_dense")
        self.value_dense = projection("value_dense")
        self.query_dense.build(queries_shape)
        self.key_dense.build(keys_shape)
        self.value_dense.build(values_shape)
        if self.output_projection:
            self.output_dense = keras.layers.Dense(query_width, use_bias=self.use_bias,
                                                   name="output_dense")
            self.output_dense.build(tuple(queries_shape[:-1]) + (units,))
        self.norm.build(queries_shape)

    def call(self, queries, keys=None, values=None, query_mask=None, key_mask=None,
             training=None, return_attention_scores=False):
        # Keys that are the queries (or none) are self-attention's, normalized in
        # pre-norm; so are values that are the queries (or none). Values of their
        # own are used as given. Tensors are told apart by identity.
        keys_are_queries = keys is None or keys is queries
        if keys_are_queries and (values is None or values is queries):
            values = None
        if query_mask is None:
            query_mask = _keras_mask(queries)
        if key_mask is None:
            key_mask = query_mask if keys_are_queries else _keras_mask(keys)
        normalized = self.pre_norm(queries)
        if keys_are_queries:
            keys = None if values is None else normalized
        outputs, weights = self.sublayer(
            normalized, keys, values,
            query_mask=query_mask, key_mask=key_mask, training=training)  # (N, T_q, C_q)
        outputs = self.post_norm(queries + self.residual_dropout(outputs, training=training))
        if return_attention_scores:
            return outputs, weights
        return outputs

    def pre_norm(self, inputs):
        """The sub-layer's input: `inputs` normalized in pre-norm, unchanged in post-norm."""
        return self.norm(inputs) if self.norm_position == "pre" else inputs

    def post_norm(self, inputs):
        """The output: the residual sum normalized in post-norm, unchanged in pre-norm."""
        return self.norm(inputs) if self.norm_position == "post" else inputs

    # The earlier name of `pre_norm`, kept for code that calls it.
    normalize_queries = pre_norm

    def sublayer(self, queries, keys=None, values=None, query_mask=None, key_mask=None,
                 training=None):
        """The attention alone: ``(outputs (N, T_q, C_q), weights (N, h, T_q, T_k))``.

        Arguments as `call`'s, with `keys` None for self-attention and no
        default masks. No dropout, residual sum or norm (see `call`).
        """
        if keys is None:
            q, k, v = self.project_self(queries)  # (N, h, T, d_k) each
        else:
            (q,) = self._project(queries, self.query_dense)  # (N, h, T_q, d_k)
            k, v = self.project_keys_values(keys, values)  # (N, h, T_k, d_k) each
        mask = self.attention_mask(query_mask, key_mask, ops.shape(queries)[1], ops.shape(k)[2])
        return self._attend_heads(q, k, v, mask)

    def attention_mask(self, query_mask, key_mask, num_queries, num_keys):
        """Boolean mask broadcastable to `(N, h, T_q, T_k)`, or None (see all)."""
        mask = None
        if key_mask is not None:
            mask = ops.cast(key_mask, "bool")[:, None, None, :]  # (N, 1, 1, T_k)
        if query_mask is not None:
            rows = ops.cast(query_mask, "bool")[:, None, :, None]  # (N, 1, T_q, 1)
            mask = rows if mask is None else ops.logical_and(mask, rows)
        if self.causality:
            future = causal_mask(num_queries, num_keys)[None, None]  # (1, 1, T_q, T_k)
            mask = future if mask is None else ops.logical_and(mask, future)
        return mask

    def project_self(self, inputs):
        """Queries, keys and values of self-attention over `inputs` `(N, T, C)`.

        Returns ``(q, k, v)``, `(N, h, T, d_k)` each. Pass the normalized inputs
        in pre-norm (`pre_norm`).
        """
        return self._project(inputs, self.query_dense, self.key_dense, self.value_dense)

    def project_keys_values(self, keys, values=None):
        """Keys and values `(N, T_k, C)` -> per-head projections `(N, h, T_k, d_k)`.

        For incremental decoding, which projects a memory once. Without
        `values`, both projections of `keys` in one product; with `values`
        (even the same tensor), one product each: for the few rows of a
        decoding step, joining the kernels costs more than it saves.
        """
        if values is None:
            return self._project(keys, self.key_dense, self.value_dense)
        return self._project(keys, self.key_dense) + self._project(values, self.value_dense)

    def _project(self, inputs, *denses):
        """`inputs` `(N, T, C_in)` through the projections `denses`, split into heads.

        The one projection path: a product by the denses' kernels side by side
        `(C_in, n*C)`, then the biases and the activation, as each `Dense`
        computes them. Projections of one input thus read it once, in one wide
        matrix product instead of `n` narrow ones, and back-propagation gets
        its gradient from one product instead of summing `n` partial ones.

        Returns:
          `len(denses)` tensors `(N, h, T, d_k)`.
        """
        kernel = ops.concatenate([dense.kernel for dense in denses], axis=-1)  # (C_in, n*C)
        outputs = ops.matmul(ops.cast(inputs, self.compute_dtype),
                             ops.cast(kernel, self.compute_dtype))  # (N, T, n*C)
        if self.use_bias:
            bias = ops.concatenate([dense.bias for dense in denses], axis=-1)  # (n*C,)
            outputs = outputs + ops.cast(bias, self.compute_dtype)
        outputs = self.projection_activation(outputs)
        return self._split_parts_into_heads(outputs, len(denses))

    def _split_parts_into_heads(self, x, parts):
        """`(N, T, parts*C)` -> `parts` tensors `(N, h, T, C/h)`, side by side in `x`.

        One transpose for all parts, then views along the leading axis
        (splitting the last axis first would copy every element once more).
        """
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        head_width = x.shape[-1] // (parts * self.num_heads)
        if parts == 1:  # no leading axis to take apart
            x = ops.reshape(x, (batch, length, self.num_heads, head_width))
            return (ops.transpose(x, (0, 2, 1, 3)),)
        x = ops.reshape(x, (batch, length, parts, self.num_heads, head_width))
        x = ops.transpose(x, (2, 0, 3, 1, 4))  # (parts, N, h, T, d_k)
        return tuple(ops.unstack(x, parts, axis=0))

    def _attend_heads(self, q, k, v, mask):
        """Attention per head, heads concatenated and projected back: ``(outputs, weights)``."""
        heads, weights = self.attention(q, k, v, mask)  # (N, h, T_q, d_k), (N, h, T_q, T_k)
        heads = ops.transpose(heads, (0, 2, 1, 3))  # (N, T_q, h, d_k)
        outputs = ops.reshape(heads, (ops.shape(heads)[0], ops.shape(heads)[1],
                                      self.num_heads * heads.shape[-1]))  # (N, T_q, C)
        if self.output_projection:
            outputs = self.output_dense(outputs)  # (N, T_q, C_q)
        return outputs, weights

    def attend_projected(self, queries, k, v, key_mask=None, training=None,
                         return_attention_scores=False):
        """Attention of `queries` `(N, T_q, C)` over projected keys/values `(N, h, T_k, d_k)`.

        The incremental-decoding counterpart of `call`: `key_mask` is boolean,
        `(N, T_k)` (the same keys for every query) or `(N, T_q, T_k)` (keys per
        query), and no causality is applied.
        """
        mask = None
        if key_mask is not None:
            key_mask = ops.cast(key_mask, "bool")
            if len(key_mask.shape) == 3:
                mask = key_mask[:, None, :, :]  # (N, 1, T_q, T_k)
            else:
                mask = key_mask[:, None, None, :]  # (N, 1, 1, T_k)
        (q,) = self._project(self.pre_norm(queries), self.query_dense)  # (N, h, T_q, d_k)
        outputs, weights = self._attend_heads(q, k, v, mask)
        outputs = self.post_norm(queries + self.residual_dropout(outputs, training=training))
        if return_attention_scores:
            return outputs, weights
        return outputs

    def compute_output_spec(self, queries, keys=None, values=None, query_mask=None,
                            key_mask=None, training=None, return_attention_scores=False):
        outputs = keras.KerasTensor(queries.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return outputs
        num_keys = (keys if keys is not None else queries).shape[1]
        weights = keras.KerasTensor(
            (queries.shape[0], self.num_heads, queries.shape[1], num_keys),
            dtype=self.compute_dtype)
        return outputs, weights

    def compute_mask(self, inputs, previous_mask=None):
        return previous_mask

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads, num_units=self.num_units, dropout_rate=self.dropout_rate,
            causality=self.causality, use_bias=self.use_bias,
            projection_activation=keras.activations.serialize(self.projection_activation),
            output_projection=self.output_projection, norm_position=self.norm_position,
            epsilon=self.epsilon, residual_dropout_rate=self.residual_dropout_rate,
            attention=keras.saving.serialize_keras_object(self.attention),
            fast_paths=self.fast_paths)
        return config


# ----------------------------------------------------------------- feedforward


@keras.saving.register_keras_serializable(package="kyu_transformer")
class FeedForward(keras.layers.Layer):
    """Position-wise feed-forward net with residual and normalization.

    The original ``feedforward`` (two 1x1 convolutions, i.e. two `Dense`).
    `sublayer` is the net alone; `call` wraps it as the paper wraps every
    sub-layer: dropout, residual sum, norm.

    Args:
      num_units: ``(inner, outer)`` widths; `outer` must equal the input width.
      dropout_rate: Dropout on the output before the residual sum (training).
      activation: Activation of the inner layer.
      norm_position: ``"post"``: ``LN(x + FF(x))``; ``"pre"``: ``x + FF(LN(x))``.
      epsilon: Epsilon of the `Normalize` layer (`norm`).
      fast_paths: Passed to its `Normalize` and `Dropout` layers.

    Call arguments:
      inputs: `(N, T, C)`.
      training: Whether dropout is active.

    Returns:
      `(N, T, C)`.
    """

    def __init__(self, num_units=(2048, 512), dropout_rate=0.0, activation="relu",
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, fast_paths=True, **kwargs):
        super().__init__(**kwargs)
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rate("dropout_rate", dropout_rate)
        if len(num_units) != 2 or min(num_units) < 1:
            raise ValueError(f"`num_units` must be two positive ints, got {num_units!r}.")
        self.num_units = tuple(int(units) for units in num_units)
        self.dropout_rate = float(dropout_rate)
        self.activation = keras.activations.get(activation)
        self.norm_position = norm_position
        self.epsilon = float(epsilon)
        self.fast_paths = bool(fast_paths)
        self.inner_dense = keras.layers.Dense(self.num_units[0], activation=self.activation,
                                              name="inner_dense")
        self.outer_dense = keras.layers.Dense(self.num_units[1], name="outer_dense")
        self.dropout = Dropout(self.dropout_rate, fast_paths=self.fast_paths)
        self.norm = Normalize(epsilon=self.epsilon, fast_paths=self.fast_paths, name="norm")
        self.supports_masking = True

    def build(self, input_shape):
        if input_shape[-1] != self.num_units[1]:
            raise ValueError(
                f"FeedForward's outer width ({self.num_units[1]}) must equal its input width "
                f"({input_shape[-1]}) for the residual connection.")
        self.inner_dense.build(input_shape)
        self.outer_dense.build(tuple(input_shape[:-1]) + (self.num_units[0],))
        self.norm.build(input_shape)

    def call(self, inputs, training=None):
        outputs = self.sublayer(self.pre_norm(inputs))  # (N, T, C)
        return self.post_norm(inputs + self.dropout(outputs, training=training))

    def sublayer(self, inputs):
        """The net alone, `(N, T, C)` -> `(N, T, C)`, before dropout, residual sum and norm."""
        return self.outer_dense(self.inner_dense(inputs))

    def pre_norm(self, inputs):
        """The sub-layer's input: `inputs` normalized in pre-norm, unchanged in post-norm."""
        return self.norm(inputs) if self.norm_position == "pre" else inputs

    def post_norm(self, inputs):
        """The output: the residual sum normalized in post-norm, unchanged in pre-norm."""
        return self.norm(inputs) if self.norm_position == "post" else inputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            num_units=list(self.num_units), dropout_rate=self.dropout_rate,
            activation=keras.activations.serialize(self.activation),
            norm_position=self.norm_position, epsilon=self.epsilon, fast_paths=self.fast_paths)
        return config


# ------------------------------------------------------------- label smoothing


def label_smoothing(inputs, epsilon=0.1):
    """Applies label smoothing (https://arxiv.org/abs/1512.00567).

    Args:
      inputs: A tensor `(..., V)` of one-hot (or any) target distributions.
      epsilon: Smoothing rate.

    Returns:
      ``(1 - epsilon) * inputs + epsilon / V``, same shape as `inputs`. For
      ``V = 3`` and ``epsilon = 0.1`` a one-hot row ``[0, 0, 1]`` becomes
      ``[0.0333, 0.0333, 0.9333]``.
    """
    inputs = ops.convert_to_tensor(inputs)
    num_classes = ops.cast(ops.shape(inputs)[-1], inputs.dtype)
    return (1.0 - epsilon) * inputs + epsilon / num_classes


# ---------------------------------------------------------------------- blocks


class _Block(keras.layers.Layer):
    """What the encoder and decoder blocks share: sizes, dropout, norm position."""

    def __init__(self, num_heads, d_ff, dropout_rate=0.0, norm_position="post",
                 epsilon=LAYER_NORM_EPSILON, fast_paths=True, **kwargs):
        super().__init__(**kwargs)
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rate("dropout_rate", dropout_rate)
        self.num_heads = int(num_heads)
        self.d_ff = int(d_ff)
        self.dropout_rate = float(dropout_rate)
        self.norm_position = norm_position
        self.epsilon = float(epsilon)
        self.fast_paths = bool(fast_paths)
        self.supports_masking = True

    def _attention(self, name, causality=False):
        return MultiHeadAttention(
            num_heads=self.num_heads, dropout_rate=self.dropout_rate, causality=causality,
            output_projection=True, norm_position=self.norm_position, epsilon=self.epsilon,
            residual_dropout_rate=self.dropout_rate, fast_paths=self.fast_paths, name=name)

    def _feed_forward(self, d_model):
        return FeedForward(
            (self.d_ff, d_model), dropout_rate=self.dropout_rate,
            norm_position=self.norm_position, epsilon=self.epsilon, fast_paths=self.fast_paths,
            name="feed_forward")

    def compute_mask(self, inputs, previous_mask=None):
        return previous_mask

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads, d_ff=self.d_ff, dropout_rate=self.dropout_rate,
            norm_position=self.norm_position, epsilon=self.epsilon, fast_paths=self.fast_paths)
        return config


@keras.saving.register_keras_serializable(package="kyu_transformer")
class EncoderBlock(_Block):
    """Self-attention then feed-forward: one encoder layer.

    Each sub-layer is wrapped as in the paper (section 3.1): its output goes
    through dropout, is added to its input, and the sum is normalized,
    ``LN(x + Dropout(Sublayer(x)))``; in pre-norm the sub-layer's input is
    normalized instead, ``x + Dropout(Sublayer(LN(x)))``.

    Args:
      num_heads: Attention heads.
      d_ff: Inner width of the feed-forward net.
      dropout_rate: Dropout on attention weights and on each sub-layer's
        output before its residual sum.
      norm_position: ``"post"`` or ``"pre"`` (see `MultiHeadAttention`).
      epsilon: Epsilon of the normalizations.
      fast_paths: Passed to its `Normalize` and `Dropout` layers.

    Call arguments:
      inputs: `(N, T, C)`.
      mask: Optional boolean `(N, T)` padding mask; default the Keras mask.
      training: Whether dropout is active.

    Returns:
      `(N, T, C)`.
    """

    def build(self, input_shape):
        self.self_attention = self._attention("self_attention")
        self.feed_forward = self._feed_forward(input_shape[-1])
        self.self_attention.build(input_shape)
        self.feed_forward.build(input_shape)

    def call(self, inputs, mask=None, training=None):
        if mask is None:
            mask = _keras_mask(inputs)
        attention, feed_forward = self.self_attention, self.feed_forward
        x = inputs  # (N, T, C)

        y, _ = attention.sublayer(attention.pre_norm(x), query_mask=mask, key_mask=mask,
                                  training=training)
        x = attention.post_norm(x + attention.residual_dropout(y, training=training))

        y = feed_forward.sublayer(feed_forward.pre_norm(x))
        x = feed_forward.post_norm(x + feed_forward.dropout(y, training=training))
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="kyu_transformer")
class DecoderBlock(_Block):
    """Causal self-attention, attention over the encoder memory, feed-forward.

    Each sub-layer is wrapped as in `EncoderBlock`.

    Args: as `EncoderBlock`.

    Call arguments:
      inputs: Decoder states `(N, T, C)`.
      memory: Encoder outputs `(N, S, C)`.
      mask: Optional boolean `(N, T)` target padding mask; default the Keras
        mask of `inputs`.
      memory_mask: Optional boolean `(N, S)` source padding mask; default the
        Keras mask of `memory`.
      training: Whether dropout is active.
      return_attention_scores: If True, also return the cross-attention
        weights `(N, h, T, S)` and their mean over heads, the "coverage"
        `(N, T, S)`.

    Returns:
      `(N, T, C)`, or ``(outputs, weights, coverage)``.
    """

    def build(self, inputs_shape, memory_shape=None):
        memory_shape = memory_shape or inputs_shape
        self.self_attention = self._attention("self_attention", causality=True)
        self.cross_attention = self._attention("cross_attention")
        self.feed_forward = self._feed_forward(inputs_shape[-1])
        self.self_attention.build(inputs_shape)
        self.cross_attention.build(inputs_shape, memory_shape)
        self.feed_forward.build(inputs_shape)

    def call(self, inputs, memory, mask=None, memory_mask=None, training=None,
             return_attention_scores=False):
        if mask is None:
            mask = _keras_mask(inputs)
        if memory_mask is None:
            memory_mask = _keras_mask(memory)
        attention, cross, feed_forward = (self.self_attention, self.cross_attention,
                                          self.feed_forward)
        x = inputs  # (N, T, C)

        y, _ = attention.sublayer(attention.pre_norm(x), query_mask=mask, key_mask=mask,
                                  training=training)
        x = attention.post_norm(x + attention.residual_dropout(y, training=training))

        y, weights = cross.sublayer(cross.pre_norm(x), memory, query_mask=mask,
                                    key_mask=memory_mask, training=training)  # weights (N, h, T, S)
        x = cross.post_norm(x + cross.residual_dropout(y, training=training))

        y = feed_forward.sublayer(feed_forward.pre_norm(x))
        x = feed_forward.post_norm(x + feed_forward.dropout(y, training=training))
        if return_attention_scores:
            return x, weights, ops.mean(weights, axis=1)  # coverage (N, T, S)
        return x

    def step(self, inputs, self_cache, memory_keys_values, memory_mask, self_mask=None):
        """One decoding step with a key/value cache, for any search to drive.

        The step's `K` new positions per sentence (one per hypothesis a search
        keeps) append their keys and values to the self-attention cache, after
        the cached ones, and attend over the grown cache as `self_mask` allows.
        The cache holds earlier positions only, so causality needs no mask;
        which cached slots belong to which hypothesis is the search's to say
        (see `decoding.beam_search`).

        Args:
          inputs: States of the newest positions `(N, K, C)`.
          self_cache: ``(keys, values)`` of the self-attention so far,
            `(N, h, T, d_k)` each.
          memory_keys_values: ``(keys, values)`` of the cross-attention, from
            ``cross_attention.project_keys_values(memory)``, `(N, h, S, d_k)`.
          memory_mask: Boolean `(N, S)` source padding mask.
          self_mask: Boolean `(N, K, T + K)`: the cache slots (this step's
            included, last) each query sees. Needed when `K` > 1; with one
            query per sentence it sees every slot.

        Returns:
          ``(outputs (N, K, C), self_cache grown to T + K slots, cross weights (N, h, K, S))``.

        Raises:
          ValueError: `K` > 1 without `self_mask`.
        """
        if not (isinstance(self_cache, (tuple, list)) and len(self_cache) == 2):
            raise TypeError("`self_cache` must be the (keys, values) pair of the cache; "
                            "`step` no longer takes the position (the cache holds the "
                            "earlier ones): step(inputs, self_cache, memory_keys_values, "
                            "memory_mask, self_mask)")
        if self_mask is None and inputs.shape[1] != 1:
            raise ValueError(f"{inputs.shape[1]} queries per sentence need a `self_mask`: "
                             "which cache slots belong to each is the search's to say")
        attention = self.self_attention
        normed = attention.pre_norm(inputs)
        new_keys, new_values = attention.project_keys_values(normed, normed)  # (N, h, K, d_k)
        keys = ops.concatenate([self_cache[0], ops.cast(new_keys, self_cache[0].dtype)], axis=2)
        values = ops.concatenate([self_cache[1], ops.cast(new_values, self_cache[1].dtype)],
                                 axis=2)  # (N, h, T + K, d_k)
        outputs = attention.attend_projected(inputs, keys, values, key_mask=self_mask)
        outputs, weights = self.cross_attention.attend_projected(
            outputs, *memory_keys_values, key_mask=memory_mask, return_attention_scores=True)
        return self.feed_forward(outputs), (keys, values), weights

    def compute_output_spec(self, inputs, memory, mask=None, memory_mask=None, training=None,
                            return_attention_scores=False):
        outputs = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return outputs
        batch, length, source_length = inputs.shape[0], inputs.shape[1], memory.shape[1]
        weights = keras.KerasTensor((batch, self.num_heads, length, source_length),
                                    dtype=self.compute_dtype)
        coverage = keras.KerasTensor((batch, length, source_length), dtype=self.compute_dtype)
        return outputs, weights, coverage


# --------------------------------------------------------------------- dropout


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Dropout(keras.layers.Dropout):
    """Keras' ``Dropout``, by `fast_paths.dropout` when `fast_paths` is True.

    Sets inputs to zero with probability `rate` in training and scales the
    others by ``1 / (1 - rate)``, as Keras' layer, whose options and config it
    keeps. With a `noise_shape`, or `fast_paths` False, Keras' own
    implementation runs.

    Args:
      rate: Fraction of the inputs to drop, in [0, 1).
      noise_shape, seed: As Keras' ``Dropout``.
      fast_paths: If True, 16-bit random draws (`fast_paths.dropout`); if
        False, Keras' ``Dropout.call``.

    Call arguments:
      inputs: Any floating-point tensor.
      training: Whether to drop (otherwise the identity).

    Returns:
      A tensor of the inputs' shape and dtype.
    """

    def __init__(self, rate, noise_shape=None, seed=None, fast_paths=True, **kwargs):
        super().__init__(rate, noise_shape=noise_shape, seed=seed, **kwargs)
        self.fast_paths = bool(fast_paths)

    def call(self, inputs, training=False):
        if self.fast_paths and training and self.rate > 0 and self.noise_shape is None:
            return fast.dropout(inputs, self.rate, self.seed_generator)
        return super().call(inputs, training=training)

    def get_config(self):
        return {**super().get_config(), "fast_paths": self.fast_paths}


# ------------------------------------------------------- kept for earlier imports


def own_history(length, hypotheses):
    """Kept for earlier imports: the beam-search cache layout is `decoding.own_history`."""
    from kyu_transformer import decoding  # the search's, not the layers' (no import cycle)

    return decoding.own_history(length, hypotheses)
