"""The Transformer building blocks as Keras 3 layers, in the order of the 2017 TF1 ``modules.py``.

Where the original was wrong the default is corrected (see each layer): the sinusoid exponent,
padding told by id 0, linear Q/K/V projections, a masking score that fits float16. Shapes in
comments: ``N`` batch, ``T_q``/``T_k`` query/key steps, ``C`` width, ``h`` heads, ``d_k`` head
width, ``V`` vocabulary. Masks are boolean (``True`` = keep), given or read from the Keras mask.
"""

import math

import keras
import numpy as np
from keras import ops

from kyu_transformer import fast_paths as fast

NORM_POSITIONS = ("post", "pre")
ENCODING_STYLES = ("interleaved", "concat")

# 1e-6 as OpenNMT-tf and tensor2tensor (the original: 1e-8); trained models keep theirs.
LAYER_NORM_EPSILON = 1e-6

# Keras' mask reader, also of JAX tracers and numpy arrays (Keras 3.15: in `keras.src` only).
_keras_mask = getattr(keras.backend, "get_keras_mask", None) or keras.src.backend.get_keras_mask


def _without_saved_switch(kwargs):
    """`kwargs` less ``fast_paths``, an argument in old saved configs, now a global setting."""
    kwargs.pop("fast_paths", None)
    return kwargs


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def _check_rates(**rates):
    for name, value in rates.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Normalize(keras.layers.LayerNormalization):
    """The original ``normalize``: Keras' ``LayerNormalization`` over the last axis, by
    `fast_paths.layer_norm` (a stated gradient) when the fast-paths switch was on at creation.

    Args:
      epsilon: Small number added to the variance.

    Call arguments:
      inputs: A tensor `(..., C)`.

    Returns:
      ``gamma * (x - mean) / sqrt(var + epsilon) + beta`` (float32 statistics), same shape.
    """

    def __init__(self, epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(epsilon=epsilon, **_without_saved_switch(kwargs))
        self.fast_paths = fast.enabled()

    def call(self, inputs):
        last = len(inputs.shape) - 1
        # The fast path computes the plain last-axis norm: gamma and beta, no RMS.
        if (self.fast_paths and self.axis in (-1, [-1], last, [last]) and self.center
                and self.scale and not self.rms_scaling):
            return fast.layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return super().call(inputs)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Embedding(keras.layers.Layer):
    """Token embedding with a zero padding row and sqrt(C) scaling (the original ``embedding``).

    Args:
      vocab_size: Number of ids `V`; num_units: width `C` of an embedding.
      zero_pad, scale: Whether id 0 (padding) embeds to exact zeros; whether to multiply the
        outputs by ``sqrt(num_units)``.
      embeddings_initializer: Of the table (Glorot uniform, the original's Xavier).

    Call arguments:
      inputs: Integer ids `(N, T)`; table: optional, `table()` (decoding computes it once).

    Returns:
      `(N, T, C)` embeddings, with the Keras mask ``ids != 0``.
    """

    def __init__(self, vocab_size, num_units, zero_pad=True, scale=True,
                 embeddings_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if vocab_size < 1 or num_units < 1:
            raise ValueError(
                f"`vocab_size` and `num_units` must be positive, got {vocab_size} and {num_units}.")
        self.vocab_size, self.num_units = int(vocab_size), int(num_units)
        self.zero_pad, self.scale = bool(zero_pad), bool(scale)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.supports_masking = True

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(name="embeddings", initializer=self._initial_table,
                                          shape=(self.vocab_size, self.num_units))
        self._keep_rows = (np.arange(self.vocab_size)[:, None] > 0).astype("float32")  # (V, 1)

    def _initial_table(self, shape, dtype=None):
        table = self.embeddings_initializer(shape, dtype=dtype)
        if self.zero_pad:  # so that `embeddings` itself shows the zero padding row
            table = ops.concatenate([ops.zeros((1, shape[1]), dtype=dtype), table[1:]], axis=0)
        return table

    def table(self):
        """The lookup table in the compute dtype, its padding row forced to zero."""
        if not self.built:
            self.build()
        table = ops.cast(self.embeddings, self.compute_dtype)  # (V, C)
        if self.zero_pad:
            # Multiplied, not just initialized, so row 0 and its gradient stay zero in training.
            table = table * ops.cast(self._keep_rows, self.compute_dtype)
        return table

    def call(self, inputs, table=None):
        table = self.table() if table is None else table
        outputs = ops.take(table, ops.cast(inputs, "int32"), axis=0)  # (N, T, C)
        if self.scale:
            outputs = outputs * ops.cast(math.sqrt(self.num_units), self.compute_dtype)
        return outputs

    def attend(self, inputs, table=None):
        """Logits ``inputs @ embeddings^T`` `(..., C)` -> `(..., V)`, for tied output weights."""
        table = self.table() if table is None else table
        return ops.matmul(inputs, ops.transpose(table))  # (..., V)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)  # (N, T)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.num_units,)

    def get_config(self):
        initializer = keras.initializers.serialize(self.embeddings_initializer)
        return dict(super().get_config(), vocab_size=self.vocab_size, num_units=self.num_units,
                    zero_pad=self.zero_pad, scale=self.scale, embeddings_initializer=initializer)


def sinusoid_table(maxlen, num_units, style="interleaved"):
    """The `(maxlen, num_units)` sinusoid encodings, as a float32 numpy array.

    ``interleaved`` (the paper): column ``i`` holds ``sin`` (even ``i``) or ``cos`` (odd ``i``)
    of ``pos / 10000^(2*floor(i/2)/num_units)`` (the original's ``2*i/num_units`` was wrong).
    ``concat`` (tensor2tensor): sines then cosines of ``num_units // 2`` geometric timescales.
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

    Args:
      maxlen: Longest sequence the layer accepts.
      num_units: Width `C`; when None, taken from the last axis of 3-D inputs.
      sinusoid, style: Fixed sinusoids of a `sinusoid_table` style; else a learned table.
      zero_pad, scale: Whether position 0 encodes to zero; whether to multiply by ``sqrt(C)``.
      masking: If True, encodings at padding (id 0, or Keras mask False) are zero.

    Call arguments:
      inputs: Ids `(N, T)` or embeddings `(N, T, C)`.
      mask: Optional boolean `(N, T)`; default the Keras mask of `inputs`, or ``ids != 0``.

    Returns:
      `(N, T, C)` encodings for the caller to add. Raises ValueError when ``T > maxlen``.
    """

    def __init__(self, maxlen, num_units=None, sinusoid=True, style="interleaved",
                 zero_pad=False, scale=False, masking=True, **kwargs):
        super().__init__(**kwargs)
        _check_choice("style", style, ENCODING_STYLES)
        if maxlen < 1:
            raise ValueError(f"`maxlen` must be positive, got {maxlen}.")
        self.maxlen, self.num_units = int(maxlen), None if num_units is None else int(num_units)
        self.sinusoid, self.style = bool(sinusoid), style
        self.zero_pad, self.scale, self.masking = bool(zero_pad), bool(scale), bool(masking)
        self.supports_masking = True

    def build(self, input_shape):
        if self.num_units is None and (len(input_shape) != 3 or input_shape[-1] is None):
            raise ValueError("PositionalEncoding needs `num_units` when its inputs are ids; "
                             f"got inputs of shape {input_shape}.")
        self._units = num_units = input_shape[-1] if self.num_units is None else self.num_units
        if self.sinusoid:
            self._sinusoids = sinusoid_table(self.maxlen, num_units, self.style)
        else:
            self.position_embeddings = self.add_weight(
                name="position_embeddings", shape=(self.maxlen, num_units),
                initializer="glorot_uniform")
        self._keep_rows = (np.arange(self.maxlen)[:, None] > 0).astype("float32")  # (maxlen, 1)

    def _table(self, length):
        return self._rows(lambda rows: rows[:length])  # (T, C)

    def encoding_at(self, position):
        """The `(1, C)` encoding of one position (a decoding step's), from that row alone."""
        index = ops.reshape(ops.cast(position, "int32"), (1,))
        return self._rows(lambda rows: ops.take(rows, index, axis=0))  # (1, C)

    def _rows(self, select):
        """The rows `select` takes of the table (and of `_keep_rows`), finished as configured."""
        table = self._sinusoids if self.sinusoid else self.position_embeddings
        rows = ops.cast(select(ops.convert_to_tensor(table)), self.compute_dtype)
        if self.zero_pad:
            keep = select(ops.convert_to_tensor(self._keep_rows))
            rows = rows * ops.cast(keep, self.compute_dtype)
        if self.scale:
            rows = rows * ops.cast(math.sqrt(self._units), self.compute_dtype)
        return rows

    def call(self, inputs, mask=None):
        length = inputs.shape[1]
        if length is None:
            length = ops.shape(inputs)[1]
        elif length > self.maxlen:
            raise ValueError(f"PositionalEncoding got a sequence of length {length}, longer "
                             f"than maxlen={self.maxlen}.")
        encodings = ops.broadcast_to(self._table(length)[None],
                                     (ops.shape(inputs)[0], length, self._units))  # (N, T, C)
        position_mask = self.compute_mask(inputs, mask)
        if self.masking and position_mask is not None:
            encodings = encodings * ops.cast(position_mask, self.compute_dtype)[..., None]
        return encodings

    def compute_mask(self, inputs, mask=None):
        mask = _keras_mask(inputs) if mask is None else mask
        if mask is None and len(inputs.shape) == 2:
            mask = ops.not_equal(inputs, 0)  # (N, T), from ids
        return mask

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], self.num_units or input_shape[-1])

    def get_config(self):
        return dict(super().get_config(), maxlen=self.maxlen, num_units=self.num_units,
                    sinusoid=self.sinusoid, style=self.style, zero_pad=self.zero_pad,
                    scale=self.scale, masking=self.masking)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class ScaledDotProductAttention(keras.layers.Layer):
    """``softmax(Q K^T / temperature) V`` over heads: `MultiHeadAttention`'s default operator,
    which any layer or callable with this call signature can replace.

    Args:
      dropout_rate: Dropout on the attention weights, in training only.
      temperature: Divisor of the scores; ``sqrt(d_k)`` when None.

    Call arguments:
      q: `(N, h, T_q, d_k)`; k: `(N, h, T_k, d_k)`; v: `(N, h, T_k, d_v)`.
      mask: Optional boolean, broadcastable to `(N, h, T_q, T_k)`; False hides a key from a
        query (one that sees no key gets all-zero weights).

    Returns:
      ``(outputs, weights)``: `(N, h, T_q, d_v)` and the weights `(N, h, T_q, T_k)` before dropout.
    """

    def __init__(self, dropout_rate=0.0, temperature=None, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_rates(dropout_rate=dropout_rate)
        self.dropout_rate, self.temperature = float(dropout_rate), temperature
        self.dropout = Dropout(self.dropout_rate)

    def call(self, q, k, v, mask=None, training=None):
        temperature = self.temperature or math.sqrt(q.shape[-1])
        # Scaled after the product: the scores are smaller than the queries when T_k < d_k,
        # and oneDNN fuses the product, the scaling and the mask's addition into one kernel.
        scores = ops.matmul(q, ops.swapaxes(k, -1, -2))  # (N, h, T_q, T_k)
        scores = scores * ops.cast(1.0 / temperature, scores.dtype)
        if mask is not None:
            # A bias (N|1, 1, T_q|1, T_k) added, not a selection: it is built at the mask's
            # size, and an addition passes its gradient through unchanged. The hidden score is
            # finite in every dtype (the original's -2**32+1 overflows float16).
            float16 = keras.backend.standardize_dtype(scores.dtype) == "float16"
            hidden_score = ops.cast(-3.0e4 if float16 else -1.0e9, scores.dtype)
            scores = scores + ops.where(mask, ops.zeros_like(hidden_score), hidden_score)
        weights = ops.softmax(scores, axis=-1)  # (N, h, T_q, T_k)
        if mask is not None:
            # A query that sees no key came out uniform: make its row exactly zero.
            sees_a_key = ops.any(mask, axis=-1, keepdims=True)  # (N|1, 1, T_q|1, 1)
            weights = weights * ops.cast(sees_a_key, weights.dtype)
        outputs = ops.matmul(self.dropout(weights, training=training), v)  # (N, h, T_q, d_v)
        return outputs, weights

    def get_config(self):
        return dict(super().get_config(), dropout_rate=self.dropout_rate,
                    temperature=self.temperature)


def residual_connection(inputs, sublayer, norm, dropout, norm_position, training=None):
    """Wraps a sub-layer `F` as the paper does (3.1): ``"post"`` (the original) gives
    ``LN(x + Dropout(F(x)))``, ``"pre"`` ``x + Dropout(F(LN(x)))``. `sublayer` returns
    ``(outputs (N, T, C), *extras)``, and so does this."""
    outputs, *extras = sublayer(norm(inputs) if norm_position == "pre" else inputs)
    outputs = inputs + dropout(outputs, training=training)
    return (norm(outputs) if norm_position == "post" else outputs, *extras)


def attention_mask(query_mask, key_mask, causal_shape=None):
    """The one mask of keys `(N, T_k)` or per query `(N, T_q, T_k)`, queries `(N, T_q)` (a
    hidden one sees no key) and causality, when `causal_shape` gives ``(T_q, T_k)``: boolean,
    broadcastable to `(N, h, T_q, T_k)`, or None (all see all)."""
    mask = None
    if key_mask is not None:
        key_mask = ops.cast(key_mask, "bool")
        mask = (key_mask[:, None, None, :] if len(key_mask.shape) == 2  # (N, 1, 1, T_k)
                else key_mask[:, None])  # (N, 1, T_q, T_k)
    if query_mask is not None:
        rows = ops.cast(query_mask, "bool")[:, None, :, None]  # (N, 1, T_q, 1)
        mask = rows if mask is None else ops.logical_and(mask, rows)
    if causal_shape is not None:  # (1, 1, T_q, T_k): query i sees key j iff j <= i
        query_steps, key_steps = (ops.arange(size) for size in causal_shape)
        causal = ops.greater_equal(query_steps[:, None], key_steps[None, :])[None, None]
        mask = causal if mask is None else ops.logical_and(mask, causal)
    return mask


def project_heads(inputs, denses, num_heads, dtype):
    """`inputs` `(N, T, C_in)` through the `Dense` layers `denses` (of the same options), as
    `len(denses)` tensors `(N, h, T, d_k)` in `dtype`: one product with the kernels side by side
    (the input read once, no partial gradients summed), parts taken apart by one transpose."""
    kernel = ops.concatenate([dense.kernel for dense in denses], axis=-1)  # (C_in, n*C)
    x = ops.matmul(ops.cast(inputs, dtype), ops.cast(kernel, dtype))  # (N, T, n*C)
    if denses[0].use_bias:
        bias = ops.concatenate([dense.bias for dense in denses], axis=-1)  # (n*C,)
        x = x + ops.cast(bias, dtype)
    x = denses[0].activation(x)
    parts, (batch, length) = len(denses), (ops.shape(x)[0], ops.shape(x)[1])
    head_width = x.shape[-1] // (parts * num_heads)
    if parts == 1:  # no leading axis to take apart
        x = ops.reshape(x, (batch, length, num_heads, head_width))
        return (ops.transpose(x, (0, 2, 1, 3)),)
    x = ops.reshape(x, (batch, length, parts, num_heads, head_width))
    # (parts, N, h, T, d_k), then views along the leading axis: splitting the last axis first
    # would copy every element once more.
    x = ops.transpose(x, (2, 0, 3, 1, 4))
    return tuple(ops.unstack(x, parts, axis=0))


def _results(outputs, *optional):
    """`outputs` alone, or a tuple of it and those of `optional` that are not None."""
    given = tuple(value for value in optional if value is not None)
    return (outputs, *given) if given else outputs


@keras.saving.register_keras_serializable(package="kyu_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """The original ``multihead_attention``: Q/K/V projections split into `num_heads` heads along
    the last axis (head ``h`` owns columns ``h*d_k:(h+1)*d_k``), attention, heads concatenated,
    the queries added back and normalized (`residual_connection`); with a `cache`, step by step.

    Args:
      num_heads: Number of heads `h`; must divide `num_units`.
      num_units: Attention width `C`; the queries' width when None.
      dropout_rate: Dropout on the attention weights (training only).
      causality: If True, query ``i`` never sees key ``j > i``.
      use_bias: Whether the projections have biases.
      projection_activation: Activation of the Q/K/V projections; ``"relu"`` as the original.
      output_projection: If True, a `Dense` (`output_dense`) maps the heads to the queries' width.
      norm_position: ``"post"`` (the original) or ``"pre"`` (`residual_connection`); in
        pre-norm self-attention the normalized queries are the keys and values.
      epsilon: Epsilon of the `Normalize` layer (`norm`).
      residual_dropout_rate: Dropout before the residual sum (training only; 0 originally).
      attention: The operator, a layer or callable ``(q, k, v, mask) -> (outputs, weights)``
        on per-head tensors; `ScaledDotProductAttention(dropout_rate)` when None.

    Call arguments:
      queries: `(N, T_q, C_q)`.
      keys: `(N, T_k, C_k)`; None (or `queries` itself) for self-attention.
      values: `(N, T_k, C_v)`; `keys` when None (used also when the keys are the queries).
      query_mask: Optional boolean `(N, T_q)`; default the Keras mask of `queries`.
      key_mask: Optional boolean `(N, T_k)`, or `(N, T_q, T_k)` per query; default the Keras
        mask of `keys` (of `queries` in self-attention; none with a `cache`).
      training: Whether dropout is active.
      return_attention_scores: If True, also return the weights.
      cache: For decoding, projected keys and values ``(k, v)`` `(N, h, T_c, d_k)`. In
        self-attention this call's join them, and `key_mask` (the slots each query sees)
        replaces `causality`; over other keys it is their `project_keys_values`, made once.

    Returns:
      `(N, T_q, C_q)`; then the weights `(N, h, T_q, T_k)` with `return_attention_scores`, and
      the cache (grown in self-attention) with one.
    """

    def __init__(self, num_heads=8, num_units=None, dropout_rate=0.0, causality=False,
                 use_bias=True, projection_activation=None, output_projection=False,
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, residual_dropout_rate=0.0,
                 attention=None, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rates(dropout_rate=dropout_rate, residual_dropout_rate=residual_dropout_rate)
        if num_heads < 1:
            raise ValueError(f"`num_heads` must be positive, got {num_heads}.")
        if num_units is not None and num_units % num_heads:
            raise ValueError(f"`num_units` ({num_units}) must be divisible by `num_heads` "
                             f"({num_heads}).")
        self.num_heads, self.dropout_rate = int(num_heads), float(dropout_rate)
        self.num_units = None if num_units is None else int(num_units)
        self.causality, self.use_bias = bool(causality), bool(use_bias)
        self.projection_activation = keras.activations.get(projection_activation)
        self.output_projection = bool(output_projection)
        self.norm_position, self.epsilon = norm_position, float(epsilon)
        self.residual_dropout_rate = float(residual_dropout_rate)
        if isinstance(attention, dict):
            attention = keras.saving.deserialize_keras_object(attention)
        self.attention = attention or ScaledDotProductAttention(self.dropout_rate)
        self.residual_dropout = Dropout(self.residual_dropout_rate)
        self.norm = Normalize(epsilon=self.epsilon, name="norm")
        self.supports_masking = True

    def build(self, queries_shape, keys_shape=None, values_shape=None):
        query_width = queries_shape[-1]
        units = self.num_units or query_width
        if units % self.num_heads:
            raise ValueError(f"The attention width ({units}) must be divisible by `num_heads` "
                             f"({self.num_heads}).")
        if units != query_width and not self.output_projection:
            raise ValueError(
                f"`num_units` ({units}) differs from the queries' width ({query_width}): "
                "the residual connection needs `output_projection=True`.")

        def projection(name, shape):
            dense = keras.layers.Dense(units, activation=self.projection_activation,
                                       use_bias=self.use_bias, name=name)
            dense.build(shape)
            return dense
        self.query_dense = projection("query_dense", queries_shape)
        self.key_dense = projection("key_dense", keys_shape or queries_shape)
        self.value_dense = projection("value_dense", values_shape or keys_shape or queries_shape)
        if self.output_projection:
            self.output_dense = keras.layers.Dense(query_width, use_bias=self.use_bias,
                                                   name="output_dense")
            self.output_dense.build(tuple(queries_shape[:-1]) + (units,))
        self.norm.build(queries_shape)

    def call(self, queries, keys=None, values=None, query_mask=None, key_mask=None,
             training=None, return_attention_scores=False, cache=None):
        # Keys (and values) that are the queries, or none, are self-attention's, normalized
        # in pre-norm; values of their own are used as given. Told apart by identity.
        self_attention = keys is None or keys is queries
        if self_attention and (values is None or values is queries):
            values = None
        query_mask = _keras_mask(queries) if query_mask is None else query_mask
        if key_mask is None and cache is None:
            key_mask = query_mask if self_attention else _keras_mask(keys)

        def attend(normalized):  # the sub-layer: (N, T_q, C_q), (N, h, T_q, T_k), cache
            q, k, v, grown = self._heads(normalized, None if self_attention else keys, values,
                                         cache)
            causal = self.causality and cache is None  # shapes read only then (loop nodes)
            mask = attention_mask(query_mask, key_mask,
                                  (ops.shape(q)[2], ops.shape(k)[2]) if causal else None)
            heads, weights = self.attention(q, k, v, mask)  # (N, h, T_q, d_k), (N, h, T_q, T_k)
            heads = ops.transpose(heads, (0, 2, 1, 3))  # (N, T_q, h, d_k), merged to (N, T_q, C)
            outputs = ops.reshape(heads, (ops.shape(heads)[0], ops.shape(heads)[1],
                                          heads.shape[2] * heads.shape[3]))
            return (self.output_dense(outputs) if self.output_projection else outputs,
                    weights, grown)
        outputs, weights, cache = residual_connection(
            queries, attend, self.norm, self.residual_dropout, self.norm_position, training)
        return _results(outputs, weights if return_attention_scores else None, cache)

    def _heads(self, queries, keys, values, cache):
        """``(q, k, v, cache)`` `(N, h, T, d_k)` for `call` (`keys` None in self-attention)."""
        if keys is None and values is None and cache is None:
            return (*self._project(queries, self.query_dense, self.key_dense,
                                   self.value_dense), None)
        (q,) = self._project(queries, self.query_dense)  # (N, h, T_q, d_k)
        if cache is not None and keys is not None:
            return (q, *cache, cache)  # other keys, projected once
        if keys is None:
            keys, values = queries, (queries if values is None else values)
        k, v = self.project_keys_values(keys, values)  # (N, h, T_k, d_k)
        if cache is not None:  # this call's positions join the cached ones
            k, v = (ops.concatenate([old, ops.cast(new, old.dtype)], axis=2)
                    for old, new in zip(cache, (k, v)))
            cache = (k, v)  # (N, h, T_c + T_q, d_k) each
        return q, k, v, cache

    def project_keys_values(self, keys, values=None):
        """Keys and values `(N, T_k, C)` -> heads `(N, h, T_k, d_k)` (a memory's `cache`): one
        product without `values`, one each with them (even `keys`), cheaper in a decoding step."""
        if values is None:
            return self._project(keys, self.key_dense, self.value_dense)
        return self._project(keys, self.key_dense) + self._project(values, self.value_dense)

    def _project(self, inputs, *denses):
        return project_heads(inputs, denses, self.num_heads, self.compute_dtype)

    def get_config(self):
        return dict(
            super().get_config(), num_heads=self.num_heads, num_units=self.num_units,
            dropout_rate=self.dropout_rate, causality=self.causality, use_bias=self.use_bias,
            projection_activation=keras.activations.serialize(self.projection_activation),
            output_projection=self.output_projection, norm_position=self.norm_position,
            epsilon=self.epsilon, residual_dropout_rate=self.residual_dropout_rate,
            attention=keras.saving.serialize_keras_object(self.attention))


@keras.saving.register_keras_serializable(package="kyu_transformer")
class FeedForward(keras.layers.Layer):
    """The original ``feedforward``: two `Dense` (its 1x1 convolutions), in `residual_connection`.

    Args:
      num_units: ``(inner, outer)`` widths; `outer` must equal the input width.
      dropout_rate: Dropout on the output before the residual sum (training).
      activation: Activation of the inner layer.
      inner_dropout_rate: Dropout on the inner activations (training; 0 originally).
      norm_position, epsilon: As `MultiHeadAttention`'s.

    Call arguments:
      inputs: `(N, T, C)`; training: whether dropout is active.

    Returns:
      `(N, T, C)`.
    """

    def __init__(self, num_units=(2048, 512), dropout_rate=0.0, activation="relu",
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, inner_dropout_rate=0.0,
                 **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rates(dropout_rate=dropout_rate, inner_dropout_rate=inner_dropout_rate)
        if len(num_units) != 2 or min(num_units) < 1:
            raise ValueError(f"`num_units` must be two positive ints, got {num_units!r}.")
        self.num_units = tuple(int(units) for units in num_units)
        self.dropout_rate, self.inner_dropout_rate = float(dropout_rate), float(inner_dropout_rate)
        self.activation = keras.activations.get(activation)
        self.norm_position, self.epsilon = norm_position, float(epsilon)
        self.inner_dense = keras.layers.Dense(self.num_units[0], activation=self.activation,
                                              name="inner_dense")
        self.outer_dense = keras.layers.Dense(self.num_units[1], name="outer_dense")
        self.dropout = Dropout(self.dropout_rate)
        self.norm = Normalize(epsilon=self.epsilon, name="norm")
        # Made last: at rate 0 it holds no random state, and the others keep their order.
        self.inner_dropout = Dropout(self.inner_dropout_rate)
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
        inner = lambda x: self.inner_dropout(self.inner_dense(x), training=training)  # noqa: E731
        return residual_connection(
            inputs, lambda x: (self.outer_dense(inner(x)),),  # (N, T, C) -> (N, T, d_ff) -> same
            self.norm, self.dropout, self.norm_position, training)[0]

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(super().get_config(), num_units=list(self.num_units),
                    dropout_rate=self.dropout_rate, inner_dropout_rate=self.inner_dropout_rate,
                    activation=keras.activations.serialize(self.activation),
                    norm_position=self.norm_position, epsilon=self.epsilon)


def label_smoothing(inputs, epsilon=0.1):
    """Label smoothing (arXiv:1512.00567): ``(1 - epsilon) * inputs + epsilon / V`` over the
    last axis `V`; at 0.1 a one-hot ``[0, 0, 1]`` becomes ``[0.0333, 0.0333, 0.9333]``."""
    inputs = ops.convert_to_tensor(inputs)
    num_classes = ops.cast(ops.shape(inputs)[-1], inputs.dtype)
    return (1.0 - epsilon) * inputs + epsilon / num_classes


class _Block(keras.layers.Layer):
    """What the blocks share; `build` makes sub-layers under the fast-paths switch of creation."""

    def __init__(self, num_heads, d_ff, dropout_rate=0.0, norm_position="post",
                 epsilon=LAYER_NORM_EPSILON, attention_dropout_rate=None, inner_dropout_rate=0.0,
                 **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        self.num_heads, self.d_ff = int(num_heads), int(d_ff)
        attention_rate = dropout_rate if attention_dropout_rate is None else attention_dropout_rate
        _check_rates(dropout_rate=dropout_rate, inner_dropout_rate=inner_dropout_rate,
                     attention_dropout_rate=attention_rate)
        self.dropout_rate, self.inner_dropout_rate = float(dropout_rate), float(inner_dropout_rate)
        self.attention_dropout_rate = float(attention_rate)
        self.norm_position, self.epsilon = norm_position, float(epsilon)
        self._fast_paths = fast.enabled()
        self.supports_masking = True

    def _attention(self, name, causality=False):
        with fast.enabled_as(self._fast_paths):
            return MultiHeadAttention(
                num_heads=self.num_heads, dropout_rate=self.attention_dropout_rate,
                causality=causality, output_projection=True, norm_position=self.norm_position,
                epsilon=self.epsilon, residual_dropout_rate=self.dropout_rate, name=name)

    def _feed_forward(self, d_model):
        with fast.enabled_as(self._fast_paths):
            return FeedForward((self.d_ff, d_model), dropout_rate=self.dropout_rate,
                               norm_position=self.norm_position, epsilon=self.epsilon,
                               inner_dropout_rate=self.inner_dropout_rate, name="feed_forward")

    def get_config(self):
        names = ("num_heads", "d_ff", "dropout_rate", "norm_position", "epsilon",
                 "attention_dropout_rate", "inner_dropout_rate")
        return dict(super().get_config(), **{name: getattr(self, name) for name in names})


@keras.saving.register_keras_serializable(package="kyu_transformer")
class EncoderBlock(_Block):
    """Self-attention then feed-forward, each wrapped by `residual_connection`: one encoder layer.

    Args:
      num_heads: Attention heads; d_ff: inner width of the feed-forward net.
      dropout_rate: Dropout on each sub-layer's output; attention_dropout_rate: on the attention
        weights (None: `dropout_rate`); inner_dropout_rate: on the feed-forward's inner values.
      norm_position, epsilon: As `MultiHeadAttention`'s, for every sub-layer.

    Call arguments:
      inputs: `(N, T, C)`; mask: optional boolean `(N, T)`, default the Keras mask.
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
        x = self.self_attention(inputs, query_mask=mask, key_mask=mask, training=training)
        return self.feed_forward(x, training=training)  # (N, T, C)

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="kyu_transformer")
class DecoderBlock(_Block):
    """Causal self-attention, attention over the encoder memory, feed-forward (as `EncoderBlock`).
    Training and decoding step by step run the same `call`, decoding with a `cache`.

    Args: as `EncoderBlock`.

    Call arguments:
      inputs: Decoder states `(N, T, C)`; memory: encoder outputs `(N, S, C)`.
      mask, memory_mask: Optional boolean `(N, T)` and `(N, S)`; default the Keras masks.
      training: Whether dropout is active.
      return_attention_scores: Also return the cross-attention weights `(N, h, T, S)` and
        their mean over heads, the "coverage" `(N, T, S)`.
      cache: From `init_cache`: ``{"self": (k, v), "cross": (k, v)}``, projected keys and values.
      self_attention_mask: With a `cache`, the slots each query sees, `(N, T, T_c + T)`; needed
        when `T` > 1, as that is the search's to say (`decoding.own_history`).

    Returns:
      `(N, T, C)`; with `return_attention_scores` ``(outputs, weights, coverage)``; the grown
      `cache` last. Raises ValueError for `T` > 1 with a `cache` and no `self_attention_mask`.
    """

    def build(self, inputs_shape, memory_shape=None):
        self.self_attention = self._attention("self_attention", causality=True)
        self.cross_attention = self._attention("cross_attention")
        self.feed_forward = self._feed_forward(inputs_shape[-1])
        self.self_attention.build(inputs_shape)
        self.cross_attention.build(inputs_shape, memory_shape or inputs_shape)
        self.feed_forward.build(inputs_shape)

    def init_cache(self, memory):
        """The `cache` before the first position: ``self`` empty `(N, h, 0, d_k)`, ``cross``
        `memory`'s keys and values `(N, h, S, d_k)`, shared by every position and hypothesis."""
        head_width = self.self_attention.key_dense.units // self.num_heads  # d_k
        empty = ops.zeros((ops.shape(memory)[0], self.num_heads, 0, head_width), memory.dtype)
        return {"self": (empty, empty), "cross": self.cross_attention.project_keys_values(memory)}

    def call(self, inputs, memory, mask=None, memory_mask=None, training=None,
             return_attention_scores=False, cache=None, self_attention_mask=None):
        if cache is not None and self_attention_mask is None and inputs.shape[1] != 1:
            raise ValueError(
                f"{inputs.shape[1]} queries per sentence need a `self_attention_mask`: "
                "which cache slots belong to each is the search's to say")
        mask = _keras_mask(inputs) if mask is None else mask
        memory_mask = _keras_mask(memory) if memory_mask is None else memory_mask
        caches = cache or {}
        # The weights are asked for so that both calls return a tuple (with the cache last).
        x, _, *grown_self = self.self_attention(
            inputs, query_mask=mask, key_mask=mask if cache is None else self_attention_mask,
            training=training, return_attention_scores=True, cache=caches.get("self"))
        x, weights, *grown_cross = self.cross_attention(
            x, memory, query_mask=mask, key_mask=memory_mask, training=training,
            return_attention_scores=True, cache=caches.get("cross"))  # weights (N, h, T, S)
        x = self.feed_forward(x, training=training)  # (N, T, C)
        coverage = ops.mean(weights, axis=1) if return_attention_scores else None  # (N, T, S)
        grown = None if cache is None else {"self": grown_self[0], "cross": grown_cross[0]}
        return _results(x, *((weights, coverage) if return_attention_scores else ()), grown)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Dropout(keras.layers.Dropout):
    """Keras' ``Dropout`` (options and config), by `fast_paths.dropout` (16-bit random draws)
    when the fast-paths switch was on as it was made and there is no `noise_shape`.

    Args:
      rate: Fraction of the inputs to drop, in [0, 1); noise_shape, seed: as Keras'.

    Call arguments:
      inputs: Any floating-point tensor; training: whether to drop (else the identity).

    Returns:
      The inputs, each zeroed with probability `rate`, the rest scaled by ``1 / (1 - rate)``.
    """

    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
        super().__init__(rate, noise_shape=noise_shape, seed=seed, **_without_saved_switch(kwargs))
        self.fast_paths = fast.enabled()

    def call(self, inputs, training=False):
        if self.fast_paths and training and self.rate > 0 and self.noise_shape is None:
            return fast.dropout(inputs, self.rate, self.seed_generator)
        return super().call(inputs, training=training)
