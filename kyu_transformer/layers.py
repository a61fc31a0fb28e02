"""Holds the Transformer building blocks as Keras 3 layers, in the order of the 2017 TF1
``modules.py``.

Where the original was wrong the default is corrected (see each layer): the sinusoid exponent,
padding told by `PAD_ID`, linear Q/K/V projections, masking that holds in float16. A sub-layer
`F` (attention, feed-forward) sits in a residual connection as the paper's section 3.1 says:
``"post"`` (the original) computes ``LN(x + Dropout(F(x)))``, ``"pre"`` ``x + Dropout(F(LN(x)))``,
``LN`` a layer norm (`Normalize`) or, with ``norm_type="scale"``, a `ScaleNorm`.
Shapes in comments: ``N`` batch, ``T_q``/``T_k`` query/key steps, ``C`` width, ``h`` heads,
``d_k`` head width, ``V`` vocabulary. Masks are boolean (``True`` = keep), given or read from the
Keras mask.
"""

import math

import keras
import numpy as np
from keras import ops

from kyu_transformer import fast_paths as fast
from kyu_transformer.conventions import (
    EMBEDDING_INITS, LAYER_NORM_EPSILON, NORM_POSITIONS, NORM_TYPES, PAD_ID, check_choice,
    check_heads, check_rates)
from kyu_transformer.replicas import replica_seeds

ENCODING_STYLES = ("interleaved", "concat")

# Keras' mask reader, also of JAX tracers and numpy arrays (Keras 3.15: in `keras.src` only).
_keras_mask = getattr(keras.backend, "get_keras_mask", None) or keras.src.backend.get_keras_mask


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Normalize(keras.layers.LayerNormalization):
    """Normalizes over the last axis (the original ``normalize``): Keras' ``LayerNormalization``,
    computed by `fast_paths.layer_norm` (a stated gradient) when the fast-paths switch was on as
    the layer was made.

    Args:
      epsilon: Small number added to the variance.

    Call arguments:
      inputs: A tensor `(..., C)`.

    Returns:
      ``gamma * (x - mean) / sqrt(var + epsilon) + beta`` (float32 statistics), same shape.
    """

    def __init__(self, epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(epsilon=epsilon, **kwargs)
        self.fast_paths = fast.enabled()

    def call(self, inputs):
        last = len(inputs.shape) - 1
        # The fast path computes the plain last-axis norm: gamma and beta, no RMS.
        if (self.fast_paths and self.axis in (-1, [-1], last, [last]) and self.center
                and self.scale and not self.rms_scaling):
            return fast.layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return super().call(inputs)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class ScaleNorm(keras.layers.Layer):
    """Scales each vector to one learned length (ScaleNorm, Nguyen & Salazar 2019, "Transformers
    without Tears"): a single gain `g` in place of layer norm's centring and per-unit gains and
    biases.

    Args:
      epsilon: Small number added to the squared length (a zero vector gives zeros, not a
        division by zero).

    Call arguments:
      inputs: A tensor `(..., C)`.

    Returns:
      ``g * x / sqrt(sum(x^2) + epsilon)`` over the last axis (float32 arithmetic), same shape;
      `g` starts at ``sqrt(C)``, the length of a unit-variance vector.
    """

    def __init__(self, epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)
        self.supports_masking = True

    def build(self, input_shape):
        # Read in float32 under a mixed policy too, as layer norm's weights: its product with
        # the float32 statistics stays float32 until the output's cast.
        self.gain = self.add_weight(
            name="gain", shape=(), autocast=False,
            initializer=keras.initializers.Constant(math.sqrt(input_shape[-1])))

    def call(self, inputs):
        x = ops.cast(inputs, "float32")
        squared_length = ops.sum(ops.square(x), axis=-1, keepdims=True)  # (..., 1)
        scale = self.gain * ops.rsqrt(squared_length + self.epsilon)  # (..., 1)
        return ops.cast(x * scale, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(super().get_config(), epsilon=self.epsilon)


def make_norm(norm_type, epsilon, name):
    """Returns the normalization `norm_type` names (`NORM_TYPES`): a `Normalize` (layer norm) or
    a `ScaleNorm`, with `epsilon`."""
    check_choice("norm_type", norm_type, NORM_TYPES)
    return (Normalize if norm_type == "layer" else ScaleNorm)(epsilon=epsilon, name=name)


def unit_rows(table):
    """Returns a table `(V, C)` with each row scaled to length 1 (float32 arithmetic, in the
    table's dtype); a zero row (padding) stays zero."""
    rows = ops.cast(table, "float32")
    squared = ops.maximum(ops.sum(ops.square(rows), axis=-1, keepdims=True), 1e-24)  # (V, 1)
    return ops.cast(rows * ops.rsqrt(squared), table.dtype)


def embedding_initializer(embedding_init, num_units):
    """Returns a new initializer of the kind `embedding_init` names (`EMBEDDING_INITS`) for a
    table `(V, num_units)`: Glorot uniform, or normal with standard deviation
    ``1 / sqrt(num_units)``. A new one for each table, so that two tables draw apart."""
    check_choice("embedding_init", embedding_init, EMBEDDING_INITS)
    if embedding_init == "glorot":
        return keras.initializers.GlorotUniform()
    return keras.initializers.RandomNormal(stddev=1.0 / math.sqrt(num_units))


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Embedding(keras.layers.Layer):
    """Looks token ids up in a table and multiplies them by ``sqrt(C)`` (the original
    ``embedding`` with its defaults ``zero_pad=True, scale=True``); `PAD_ID` embeds to zeros.

    The padding row is multiplied by zero at every lookup, not only set to zero at the start,
    so that it and its gradient stay zero in training.

    Args:
      vocab_size: Number of ids `V`.
      num_units: Width `C` of an embedding.
      embeddings_initializer: Initializer of the table (Glorot uniform, the original's Xavier).
      unit_norm: FixNorm (Nguyen & Chiang 2018): every row is read at length 1 (`unit_rows`),
        by the lookups and by `attend`, whose logits are then lengths times cosines.

    Call arguments:
      inputs: Integer ids `(N, T)`.
      table: Optional, the result of `table()`, for a caller that makes it once (decoding).

    Returns:
      Embeddings `(N, T, C)`, with the Keras mask ``ids != PAD_ID``.
    """

    def __init__(self, vocab_size, num_units, embeddings_initializer="glorot_uniform",
                 unit_norm=False, **kwargs):
        super().__init__(**kwargs)
        if vocab_size < 1 or num_units < 1:
            raise ValueError(
                f"`vocab_size` and `num_units` must be positive, got {vocab_size} and {num_units}.")
        self.vocab_size, self.num_units = int(vocab_size), int(num_units)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.unit_norm = bool(unit_norm)
        self.supports_masking = True

    def build(self, input_shape=None):
        keep = np.arange(self.vocab_size)[:, None] != PAD_ID  # (V, 1)
        self._keep_rows = keep.astype("float32")
        self.embeddings = self.add_weight(name="embeddings", initializer=self._initial_table,
                                          shape=(self.vocab_size, self.num_units))

    def _initial_table(self, shape, dtype=None):
        """Draws the table from the initializer with its padding row zero, so that `embeddings`
        itself shows that row as the lookups see it."""
        table = self.embeddings_initializer(shape, dtype=dtype)
        return ops.where(ops.convert_to_tensor(self._keep_rows > 0), table, ops.zeros_like(table))

    def table(self):
        """Returns the lookup table `(V, C)` in the compute dtype, its padding row zero (and the
        others of length 1 with `unit_norm`)."""
        if not self.built:
            self.build()
        table = unit_rows(self.embeddings) if self.unit_norm else self.embeddings
        table = ops.cast(table, self.compute_dtype)  # (V, C)
        return table * ops.cast(self._keep_rows, self.compute_dtype)

    def call(self, inputs, table=None):
        table = self.table() if table is None else table
        outputs = ops.take(table, ops.cast(inputs, "int32"), axis=0)  # (N, T, C)
        return outputs * ops.cast(math.sqrt(self.num_units), self.compute_dtype)

    def attend(self, inputs, table=None):
        """Returns the logits ``inputs @ table^T`` `(..., V)` of states `(..., C)`: the output
        layer whose weights are the embeddings'."""
        table = self.table() if table is None else table
        return ops.matmul(inputs, ops.transpose(table))  # (..., V)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, PAD_ID)  # (N, T)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.num_units,)

    def get_config(self):
        initializer = keras.initializers.serialize(self.embeddings_initializer)
        return dict(super().get_config(), vocab_size=self.vocab_size, num_units=self.num_units,
                    embeddings_initializer=initializer, unit_norm=self.unit_norm)


def sinusoid_table(maxlen, num_units, style="interleaved"):
    """Returns the `(maxlen, num_units)` sinusoid encodings as a float32 numpy array.

    ``interleaved`` (the paper): column ``i`` holds ``sin`` (even ``i``) or ``cos`` (odd ``i``)
    of ``pos / 10000^(2*floor(i/2)/num_units)`` (the original's ``2*i/num_units`` was wrong).
    ``concat`` (tensor2tensor): sines then cosines of ``num_units // 2`` geometric timescales.
    """
    check_choice("style", style, ENCODING_STYLES)
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
    """Returns the encodings of its inputs' positions, for the caller to add to the embeddings:
    fixed sinusoids or a learned table, zero at padding. This is the original
    ``positional_encoding`` as its ``train.py`` called it (``zero_pad=False, scale=False``).

    Args:
      maxlen: Longest sequence the layer accepts.
      num_units: Width `C`; when None, taken from the last axis of 3-D inputs.
      sinusoid: Fixed sinusoids (True) or a learned `(maxlen, C)` table (False).
      style: Layout of the sinusoids, ``"interleaved"`` or ``"concat"`` (see `sinusoid_table`).

    Call arguments:
      inputs: Ids `(N, T)` or embeddings `(N, T, C)`.
      mask: Optional boolean `(N, T)`; by default the Keras mask of `inputs`, or
        ``ids != PAD_ID``.

    Returns:
      Encodings `(N, T, C)`, zero where the mask is False. Raises ValueError when ``T > maxlen``.
    """

    def __init__(self, maxlen, num_units=None, sinusoid=True, style="interleaved", **kwargs):
        super().__init__(**kwargs)
        check_choice("style", style, ENCODING_STYLES)
        if maxlen < 1:
            raise ValueError(f"`maxlen` must be positive, got {maxlen}.")
        self.maxlen, self.num_units = int(maxlen), None if num_units is None else int(num_units)
        self.sinusoid, self.style = bool(sinusoid), style
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

    def _rows(self):
        """Returns the whole `(maxlen, C)` table as a tensor, in its own dtype."""
        return ops.convert_to_tensor(self._sinusoids if self.sinusoid
                                     else self.position_embeddings)

    def _table(self, length):
        """Returns the encodings of the first `length` positions `(T, C)`."""
        return ops.cast(self._rows()[:length], self.compute_dtype)

    def encoding_at(self, position):
        """Returns the `(1, C)` encoding of one position (a decoding step's), cast from that
        row alone."""
        index = ops.reshape(ops.cast(position, "int32"), (1,))
        return ops.cast(ops.take(self._rows(), index, axis=0), self.compute_dtype)  # (1, C)

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
        if position_mask is not None:
            encodings = encodings * ops.cast(position_mask, self.compute_dtype)[..., None]
        return encodings

    def compute_mask(self, inputs, mask=None):
        mask = _keras_mask(inputs) if mask is None else mask
        if mask is None and len(inputs.shape) == 2:
            mask = ops.not_equal(inputs, PAD_ID)  # (N, T), from ids
        return mask

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], self.num_units or input_shape[-1])

    def get_config(self):
        return dict(super().get_config(), maxlen=self.maxlen, num_units=self.num_units,
                    sinusoid=self.sinusoid, style=self.style)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class ScaledDotProductAttention(keras.layers.Layer):
    """Computes ``softmax(Q K^T / sqrt(d_k)) V`` for every head: `MultiHeadAttention`'s attention.
    In float16 the softmax is computed in float32 (the weights returned in float16).

    Args:
      dropout_rate: Dropout on the attention weights, in training only.

    Call arguments:
      q: `(N, h, T_q, d_k)`; k: `(N, h, T_k, d_k)`; v: `(N, h, T_k, d_v)`.
      mask: Optional boolean, broadcastable to `(N, h, T_q, T_k)`; False hides a key from a
        query (one that sees no key gets all-zero weights).
      training: Whether dropout is active.

    Returns:
      ``(outputs, weights)``: `(N, h, T_q, d_v)` and the weights `(N, h, T_q, T_k)` before dropout.
    """

    def __init__(self, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        check_rates(dropout_rate=dropout_rate)
        self.dropout_rate = float(dropout_rate)
        self.dropout = Dropout(self.dropout_rate)

    def call(self, q, k, v, mask=None, training=None):
        # The queries are scaled before the product, so that the product is the score: formed
        # first, it is sqrt(d_k) times larger and overflows float16 (largest 65504) to Inf
        # where the score would not.
        q = q * ops.cast(1.0 / math.sqrt(q.shape[-1]), q.dtype)
        scores = ops.matmul(q, ops.swapaxes(k, -1, -2))  # (N, h, T_q, T_k)
        if keras.backend.standardize_dtype(scores.dtype) == "float16":
            # float16's softmax is computed in float32: no float16 bias hides a key whose score
            # may be near +65504 (the sum would need a bias below -131008), and a bias added to
            # a score near -65504 overflows to -inf (a row of -inf gives NaN).
            scores = ops.cast(scores, "float32")
        if mask is not None:
            # A bias (N|1, 1, T_q|1, T_k) added, not a selection: it is built at the mask's
            # size, and an addition passes its gradient through unchanged. In float32 (or
            # bfloat16) it lies far below every score, so its key's weight is exactly zero.
            hidden_score = ops.cast(-1.0e9, scores.dtype)
            scores = scores + ops.where(mask, ops.zeros_like(hidden_score), hidden_score)
        weights = ops.softmax(scores, axis=-1)  # (N, h, T_q, T_k)
        if mask is not None:
            # A query that sees no key came out uniform: make its row exactly zero.
            sees_a_key = ops.any(mask, axis=-1, keepdims=True)  # (N|1, 1, T_q|1, 1)
            weights = weights * ops.cast(sees_a_key, weights.dtype)
        weights = ops.cast(weights, q.dtype)
        outputs = ops.matmul(self.dropout(weights, training=training), v)  # (N, h, T_q, d_v)
        return outputs, weights

    def get_config(self):
        return dict(super().get_config(), dropout_rate=self.dropout_rate)


def attention_mask(query_mask, key_mask, causal_shape=None):
    """Combines the masks of the keys, of the queries and causality into one boolean mask,
    broadcastable to `(N, h, T_q, T_k)`, or None when every query sees every key.

    `key_mask` is `(N, T_k)`, or `(N, T_q, T_k)` per query; a query hidden by `query_mask`
    `(N, T_q)` sees no key; `causal_shape` ``(T_q, T_k)``, if given, hides key ``j > i`` from
    query ``i``.
    """
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
    """Passes `inputs` `(N, T, C_in)` through the `Dense` layers `denses` (of the same options)
    and returns `len(denses)` tensors `(N, h, T, d_k)` in `dtype`.

    It computes one product with the kernels side by side (the input is read once, and no
    partial gradients are summed), and takes the parts apart by one transpose.
    """
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


@keras.saving.register_keras_serializable(package="kyu_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Attends from queries to keys with `num_heads` heads (the original
    ``multihead_attention``), in a residual connection with its normalization.

    The Q/K/V projections are split into heads along the last axis (head ``h`` owns columns
    ``h*d_k:(h+1)*d_k``); the heads' outputs are concatenated and added to the queries. With a
    `cache` it attends one decoding step at a time.

    Args:
      num_heads: Number of heads `h`; it must divide the queries' width `C` (``d_model``).
      dropout_rate: Dropout on the attention weights (training only).
      causality: If True, query ``i`` never sees key ``j > i``.
      use_bias: Whether the projections have biases (the versions of March to September
        2019 of the original have none).
      projection_activation: Activation of the Q/K/V projections; ``"relu"`` as the original.
      output_projection: If True, a `Dense` (`output_dense`) maps the concatenated heads.
      norm_position: ``"post"`` (the original) or ``"pre"`` (see the module's docstring); in
        pre-norm self-attention the normalized queries are also the keys and values.
      epsilon: Epsilon of the normalization (`norm`).
      norm_type: ``"layer"`` (a `Normalize`, the original) or ``"scale"`` (a `ScaleNorm`).
      residual_dropout_rate: Dropout before the residual sum (training only; 0 originally).

    Call arguments:
      queries: `(N, T_q, C)`.
      keys: `(N, T_k, C_k)`, or None for self-attention (the queries are the keys).
      values: `(N, T_k, C_v)`; the keys when None. Only with `keys`.
      query_mask: Optional boolean `(N, T_q)`; default the Keras mask of `queries`.
      key_mask: Optional boolean `(N, T_k)`, or `(N, T_q, T_k)` per query; default the Keras
        mask of `keys` (of `queries` in self-attention; none with a `cache`).
      training: Whether dropout is active.
      cache: For decoding, projected keys and values ``(k, v)`` `(N, h, T_c, d_k)`. In
        self-attention this call's join them, and `key_mask` (the slots each query sees)
        replaces `causality`; over other keys it is their `project_keys_values`, made once.

    Returns:
      ``(outputs, weights, cache)``: outputs `(N, T_q, C)`; the attention weights
      `(N, h, T_q, T_k)` before dropout; the projected keys and values ``(k, v)``
      `(N, h, T_k, d_k)` the queries attended to, which are the next decoding step's `cache`
      (the given one grown by this call's positions in self-attention).
    """

    def __init__(self, num_heads=8, dropout_rate=0.0, causality=False, use_bias=True,
                 projection_activation=None, output_projection=False, norm_position="post",
                 epsilon=LAYER_NORM_EPSILON, residual_dropout_rate=0.0, norm_type="layer",
                 **kwargs):
        super().__init__(**kwargs)
        check_choice("norm_position", norm_position, NORM_POSITIONS)
        check_rates(dropout_rate=dropout_rate, residual_dropout_rate=residual_dropout_rate)
        self.num_heads, self.dropout_rate = int(num_heads), float(dropout_rate)
        self.causality, self.use_bias = bool(causality), bool(use_bias)
        self.projection_activation = keras.activations.get(projection_activation)
        self.output_projection = bool(output_projection)
        self.norm_position, self.epsilon = norm_position, float(epsilon)
        self.residual_dropout_rate, self.norm_type = float(residual_dropout_rate), norm_type
        self.attention = ScaledDotProductAttention(self.dropout_rate)
        self.residual_dropout = Dropout(self.residual_dropout_rate)
        self.norm = make_norm(norm_type, self.epsilon, name="norm")
        self.supports_masking = True

    def build(self, queries_shape, keys_shape=None, values_shape=None):
        width = queries_shape[-1]  # C, which the heads split
        check_heads(width, self.num_heads)
        self.query_dense = self._projection("query_dense", width, queries_shape)
        self.key_dense = self._projection("key_dense", width, keys_shape or queries_shape)
        self.value_dense = self._projection("value_dense", width,
                                            values_shape or keys_shape or queries_shape)
        if self.output_projection:
            self.output_dense = keras.layers.Dense(width, use_bias=self.use_bias,
                                                   name="output_dense")
            self.output_dense.build(queries_shape)
        self.norm.build(queries_shape)

    def _projection(self, name, width, input_shape):
        """Makes and builds one of the Q/K/V projections, `width` wide."""
        dense = keras.layers.Dense(width, activation=self.projection_activation,
                                   use_bias=self.use_bias, name=name)
        dense.build(input_shape)
        return dense

    def call(self, queries, keys=None, values=None, query_mask=None, key_mask=None,
             training=None, cache=None):
        if keys is None and values is not None:
            raise ValueError("`values` need `keys`: self-attention (`keys` None) attends over "
                             "its queries.")
        query_mask = _keras_mask(queries) if query_mask is None else query_mask
        if key_mask is None and cache is None:
            key_mask = query_mask if keys is None else _keras_mask(keys)
        causal = self.causality and cache is None  # a cache's `key_mask` says what is seen
        x = self.norm(queries) if self.norm_position == "pre" else queries  # (N, T_q, C)
        q, k, v = self._heads(x, keys, values, cache)  # (N, h, T, d_k) each
        mask = attention_mask(query_mask, key_mask,
                              (ops.shape(q)[2], ops.shape(k)[2]) if causal else None)
        heads, weights = self.attention(q, k, v, mask, training=training)  # (N, h, T_q, d_k)
        heads = ops.transpose(heads, (0, 2, 1, 3))  # (N, T_q, h, d_k)
        outputs = ops.reshape(heads, (ops.shape(heads)[0], ops.shape(heads)[1],
                                      heads.shape[2] * heads.shape[3]))  # (N, T_q, C)
        if self.output_projection:
            outputs = self.output_dense(outputs)
        outputs = queries + self.residual_dropout(outputs, training=training)
        if self.norm_position == "post":
            outputs = self.norm(outputs)
        return outputs, weights, (k, v)  # weights (N, h, T_q, T_k)

    def _heads(self, x, keys, values, cache):
        """Returns the queries, keys and values as heads ``(q, k, v)`` `(N, h, T, d_k)`, of
        the (normalized) queries `x` and the call's `keys`, `values` and `cache`."""
        if keys is None and cache is None:  # self-attention: the three projections in one
            return self._project(x, self.query_dense, self.key_dense, self.value_dense)
        (q,) = self._project(x, self.query_dense)  # (N, h, T_q, d_k)
        if keys is None:  # a decoding step of self-attention: its positions join the cache
            k, v = (ops.concatenate([old, ops.cast(new, old.dtype)], axis=2)
                    for old, new in zip(cache, self.project_keys_values(x, x)))
            return q, k, v  # (N, h, T_c + T_q, d_k)
        if cache is not None:  # other keys, projected once before the first step
            return (q, *cache)
        return (q, *self.project_keys_values(keys, values))

    def project_keys_values(self, keys, values=None):
        """Projects keys and values `(N, T_k, C)` to heads ``(k, v)`` `(N, h, T_k, d_k)` (a
        memory's `cache`): with one product of `keys` when `values` is None, with one product
        each when they are given (even the same tensor), cheaper for a decoding step."""
        if values is None:
            return self._project(keys, self.key_dense, self.value_dense)
        return self._project(keys, self.key_dense) + self._project(values, self.value_dense)

    def _project(self, inputs, *denses):
        return project_heads(inputs, denses, self.num_heads, self.compute_dtype)

    def get_config(self):
        return dict(
            super().get_config(), num_heads=self.num_heads, dropout_rate=self.dropout_rate,
            causality=self.causality, use_bias=self.use_bias,
            projection_activation=keras.activations.serialize(self.projection_activation),
            output_projection=self.output_projection, norm_position=self.norm_position,
            epsilon=self.epsilon, residual_dropout_rate=self.residual_dropout_rate,
            norm_type=self.norm_type)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class FeedForward(keras.layers.Layer):
    """Applies two `Dense` layers to each position (the original ``feedforward``'s 1x1
    convolutions), in a residual connection with its normalization.

    Args:
      num_units: ``(inner, outer)`` widths; `outer` must equal the input width.
      dropout_rate: Dropout on the output before the residual sum (training).
      activation: Activation of the inner layer (``"relu"`` as the original).
      norm_position, epsilon, norm_type: As `MultiHeadAttention`'s.
      inner_dropout_rate: Dropout on the inner activations (training; 0 originally).

    Call arguments:
      inputs: `(N, T, C)`; training: whether dropout is active.

    Returns:
      `(N, T, C)`.
    """

    def __init__(self, num_units=(2048, 512), dropout_rate=0.0, activation="relu",
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, inner_dropout_rate=0.0,
                 norm_type="layer", **kwargs):
        super().__init__(**kwargs)
        check_choice("norm_position", norm_position, NORM_POSITIONS)
        check_rates(dropout_rate=dropout_rate, inner_dropout_rate=inner_dropout_rate)
        if len(num_units) != 2 or min(num_units) < 1:
            raise ValueError(f"`num_units` must be two positive ints, got {num_units!r}.")
        self.num_units = tuple(int(units) for units in num_units)
        self.dropout_rate, self.inner_dropout_rate = float(dropout_rate), float(inner_dropout_rate)
        self.activation = keras.activations.get(activation)
        self.norm_position, self.epsilon = norm_position, float(epsilon)
        self.inner_dense = keras.layers.Dense(self.num_units[0], activation=self.activation,
                                              name="inner_dense")
        self.inner_dropout = Dropout(self.inner_dropout_rate)
        self.outer_dense = keras.layers.Dense(self.num_units[1], name="outer_dense")
        self.dropout = Dropout(self.dropout_rate)
        self.norm_type = norm_type
        self.norm = make_norm(norm_type, self.epsilon, name="norm")
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
        x = self.norm(inputs) if self.norm_position == "pre" else inputs  # (N, T, C)
        x = self.inner_dropout(self.inner_dense(x), training=training)  # (N, T, d_ff)
        outputs = inputs + self.dropout(self.outer_dense(x), training=training)  # (N, T, C)
        return self.norm(outputs) if self.norm_position == "post" else outputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(super().get_config(), num_units=list(self.num_units),
                    dropout_rate=self.dropout_rate, inner_dropout_rate=self.inner_dropout_rate,
                    activation=keras.activations.serialize(self.activation),
                    norm_position=self.norm_position, epsilon=self.epsilon,
                    norm_type=self.norm_type)


def label_smoothing(inputs, epsilon=0.1):
    """Smooths one-hot labels (arXiv:1512.00567): returns ``(1 - epsilon) * inputs + epsilon / V``
    over the last axis `V`; at 0.1 a one-hot ``[0, 0, 1]`` becomes ``[0.0333, 0.0333, 0.9333]``."""
    inputs = ops.convert_to_tensor(inputs)
    num_classes = ops.cast(ops.shape(inputs)[-1], inputs.dtype)
    return (1.0 - epsilon) * inputs + epsilon / num_classes


class _Block(keras.layers.Layer):
    """Holds what the encoder and decoder blocks share.

    A block makes its sub-layers in `build`, where the width is known, and gives them the
    fast-paths choice the block itself was made with (`set_fast_paths`), so that a block made
    with the switch off builds without fast paths whatever the switch is by then.
    """

    def __init__(self, num_heads, d_ff, dropout_rate=0.0, norm_position="post",
                 epsilon=LAYER_NORM_EPSILON, attention_dropout_rate=None, inner_dropout_rate=0.0,
                 norm_type="layer", **kwargs):
        super().__init__(**kwargs)
        check_choice("norm_position", norm_position, NORM_POSITIONS)
        check_choice("norm_type", norm_type, NORM_TYPES)
        self.num_heads, self.d_ff = int(num_heads), int(d_ff)
        attention_rate = dropout_rate if attention_dropout_rate is None else attention_dropout_rate
        check_rates(dropout_rate=dropout_rate, inner_dropout_rate=inner_dropout_rate,
                    attention_dropout_rate=attention_rate)
        self.dropout_rate, self.inner_dropout_rate = float(dropout_rate), float(inner_dropout_rate)
        self.attention_dropout_rate = float(attention_rate)
        self.norm_position, self.epsilon = norm_position, float(epsilon)
        self.norm_type, self.fast_paths = norm_type, fast.enabled()
        self.supports_masking = True

    def _attention(self, name, causality=False):
        return set_fast_paths(MultiHeadAttention(
            num_heads=self.num_heads, dropout_rate=self.attention_dropout_rate,
            causality=causality, output_projection=True, norm_position=self.norm_position,
            epsilon=self.epsilon, residual_dropout_rate=self.dropout_rate,
            norm_type=self.norm_type, name=name), self.fast_paths)

    def _feed_forward(self, d_model):
        return set_fast_paths(FeedForward(
            (self.d_ff, d_model), dropout_rate=self.dropout_rate,
            norm_position=self.norm_position, epsilon=self.epsilon,
            inner_dropout_rate=self.inner_dropout_rate, norm_type=self.norm_type,
            name="feed_forward"), self.fast_paths)

    def get_config(self):
        names = ("num_heads", "d_ff", "dropout_rate", "norm_position", "epsilon",
                 "attention_dropout_rate", "inner_dropout_rate", "norm_type")
        return dict(super().get_config(), **{name: getattr(self, name) for name in names})


@keras.saving.register_keras_serializable(package="kyu_transformer")
class EncoderBlock(_Block):
    """Applies self-attention, then a feed-forward net, each in its residual connection: one
    encoder layer.

    Args:
      num_heads: Attention heads; d_ff: inner width of the feed-forward net.
      dropout_rate: Dropout on each sub-layer's output.
      norm_position, epsilon, norm_type: As `MultiHeadAttention`'s, for every sub-layer.
      attention_dropout_rate: Dropout on the attention weights; None: `dropout_rate`.
      inner_dropout_rate: Dropout on the feed-forward net's inner activations.

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
        x, _, _ = self.self_attention(inputs, query_mask=mask, key_mask=mask, training=training)
        return self.feed_forward(x, training=training)  # (N, T, C)

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="kyu_transformer")
class DecoderBlock(_Block):
    """Applies causal self-attention, attention over the encoder's memory, then a feed-forward
    net, each in its residual connection: one decoder layer. Training and decoding step by
    step run the same `call`, decoding with a `cache`.

    Args: as `EncoderBlock`.

    Call arguments:
      inputs: Decoder states `(N, T, C)`; memory: encoder outputs `(N, S, C)`.
      mask, memory_mask: Optional boolean `(N, T)` and `(N, S)`; default the Keras masks.
      training: Whether dropout is active.
      return_attention_scores: Also return the cross-attention weights `(N, h, T, S)` and
        their mean over heads, the "coverage" `(N, T, S)`.
      cache: From `init_cache`: ``{"self": (k, v), "cross": (k, v)}``, projected keys and values.
      self_attention_mask: With a `cache`, the slots each query sees, `(N, T, T_c + T)`; needed
        when `T` > 1, as that is the search's to say (`decoding.search.own_history`).

    Returns:
      `(N, T, C)`; with `return_attention_scores` ``(outputs, weights, coverage)``; with a
      `cache`, the grown cache last. Raises ValueError for `T` > 1 with a `cache` and no
      `self_attention_mask`.
    """

    def build(self, inputs_shape, memory_shape=None):
        self.self_attention = self._attention("self_attention", causality=True)
        self.cross_attention = self._attention("cross_attention")
        self.feed_forward = self._feed_forward(inputs_shape[-1])
        self.self_attention.build(inputs_shape)
        self.cross_attention.build(inputs_shape, memory_shape or inputs_shape)
        self.feed_forward.build(inputs_shape)

    def init_cache(self, memory):
        """Returns the `cache` before the first position: ``self`` empty `(N, h, 0, d_k)`,
        ``cross`` the keys and values of `memory` `(N, h, S, d_k)`, which every position and
        hypothesis shares."""
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
        x, _, self_cache = self.self_attention(
            inputs, query_mask=mask, key_mask=mask if cache is None else self_attention_mask,
            training=training, cache=caches.get("self"))  # (N, T, C)
        x, weights, cross_cache = self.cross_attention(
            x, memory, query_mask=mask, key_mask=memory_mask, training=training,
            cache=caches.get("cross"))  # weights (N, h, T, S)
        x = self.feed_forward(x, training=training)  # (N, T, C)
        results = (x, weights, ops.mean(weights, axis=1)) if return_attention_scores else (x,)
        if cache is not None:
            results += ({"self": self_cache, "cross": cross_cache},)
        return results if len(results) > 1 else x


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Dropout(keras.layers.Dropout):
    """Drops a `rate` of its inputs in training: Keras' ``Dropout`` (options and config),
    computed by `fast_paths.dropout` (16-bit random draws) when the fast-paths switch was on as
    the layer was made and there is no `noise_shape`. Under `tf.distribute` each replica draws
    its own mask (`replicas.replica_seeds`).

    Args:
      rate: Fraction of the inputs to drop, in [0, 1); noise_shape, seed: as Keras'.

    Call arguments:
      inputs: Any floating-point tensor; training: whether to drop (else the identity).

    Returns:
      The inputs, each zeroed with probability `rate`, the rest scaled by ``1 / (1 - rate)``.
    """

    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
        super().__init__(rate, noise_shape=noise_shape, seed=seed, **kwargs)
        self.fast_paths = fast.enabled()

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        # Each replica of a distributed step draws its own mask (the layer's seeds with the
        # replica's id folded in); replica 0 and a single device draw the layer's own.
        seeds = replica_seeds(self.seed_generator)
        if self.fast_paths and self.noise_shape is None:
            return fast.dropout(inputs, self.rate, seeds)
        return keras.random.dropout(inputs, self.rate, noise_shape=self.noise_shape, seed=seeds)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class LayerDrop(keras.layers.Layer):
    """Drops a whole block in training (LayerDrop, Fan et al. 2019): with probability `rate`
    the block's outputs are replaced by its inputs, one draw per call (per block and batch),
    unscaled. The block is computed either way (a choice of values, which every backend can
    differentiate and compile), so it regularizes without saving compute. Under
    `tf.distribute` each replica draws its own (`replicas.replica_seeds`).

    Args:
      rate: Probability of dropping the block, in [0, 1); seed: of the draws, as Keras'.

    Call arguments:
      inputs: The block's inputs; outputs: its outputs, of the same shape and dtype.
      training: Whether to drop (else the outputs, always).

    Returns:
      `outputs`, or `inputs` in place of them with probability `rate`.
    """

    def __init__(self, rate, seed=None, **kwargs):
        super().__init__(**kwargs)
        check_rates(rate=rate)
        self.rate, self.seed = float(rate), seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.supports_masking = True  # the same positions either way: the inputs' mask

    def call(self, inputs, outputs, training=False):
        if not training or self.rate == 0:
            return outputs
        draw = keras.random.uniform((), seed=replica_seeds(self.seed_generator))
        return ops.where(draw >= self.rate, outputs, inputs)

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


def set_fast_paths(layer, on):
    """Sets whether `layer` and the layers inside it take the fast paths, as if they had been
    made while `fast_paths.set_enabled(on)` held, and returns `layer`.

    A block not yet built passes the choice on to the sub-layers it makes when it builds.
    """
    for sub_layer in layer._flatten_layers():
        if isinstance(sub_layer, (Normalize, Dropout, _Block)):
            sub_layer.fast_paths = bool(on)
    return layer
