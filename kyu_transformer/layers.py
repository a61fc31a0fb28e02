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
``Dropout`` compute: by the CPU fast paths of `kyu_transformer.fast_paths`
when its switch (one global setting, on by default) was on as they were made,
else by Keras' own.
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


def _without_saved_switch(kwargs):
    """`kwargs` without ``fast_paths``, once an argument of every layer, now a global
    setting (`fast_paths.enabled`): configs saved before carry it; it is ignored."""
    kwargs.pop("fast_paths", None)
    return kwargs


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

    Over the last axis, `fast_paths.layer_norm` (a stated gradient) when the
    switch was on as the layer was made (`fast_paths`), else Keras' own.

    Call arguments:
      inputs: A tensor `(..., C)`.

    Returns:
      A tensor of the same shape; weights `gamma` (ones) and `beta` (zeros) of
      shape `(C,)`.
    """

    def __init__(self, epsilon=LAYER_NORM_EPSILON, **kwargs):
        kwargs.setdefault("axis", -1)
        super().__init__(epsilon=epsilon, **_without_saved_switch(kwargs))
        self.fast_paths = fast.enabled()

    def call(self, inputs):
        if self.fast_paths and self._is_plain_last_axis_norm(inputs):
            return fast.layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return super().call(inputs)

    def _is_plain_last_axis_norm(self, inputs):
        """Whether the fast path computes this layer: last axis, gamma and beta, no RMS."""
        last = len(inputs.shape) - 1
        return (self.axis in (-1, [-1], last, [last]) and self.center and self.scale
                and not self.rms_scaling)


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

    Call arguments:
      q: `(N, h, T_q, d_k)`; k: `(N, h, T_k, d_k)`; v: `(N, h, T_k, d_v)`.
      mask: Optional boolean, broadcastable to `(N, h, T_q, T_k)`; False hides
        a key from a query. A query that sees no key gets all-zero weights.

    Returns:
      ``(outputs, weights)``: `(N, h, T_q, d_v)` and the weights before dropout
      `(N, h, T_q, T_k)`.
    """

    def __init__(self, dropout_rate=0.0, temperature=None, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_rate("dropout_rate", dropout_rate)
        self.dropout_rate = float(dropout_rate)
        self.temperature = temperature
        self.dropout = Dropout(self.dropout_rate)

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
        config.update(dropout_rate=self.dropout_rate, temperature=self.temperature)
        return config


def residual_connection(inputs, sublayer, norm, dropout, norm_position, training=None):
    """The rule around every sub-layer (the paper's section 3.1), written once.

    ``"post"`` (the original): ``LN(x + Dropout(F(x)))``; ``"pre"``:
    ``x + Dropout(F(LN(x)))``. `MultiHeadAttention` and `FeedForward` apply it
    in their `call`, so the blocks made of them only call them.

    Args:
      inputs: The sub-layer's input `x` `(N, T, C)`.
      sublayer: `F`: its (normalized in pre-norm) input -> ``(outputs (N, T, C), *extras)``.
      norm: The `Normalize` layer; dropout: the `Dropout` on `F`'s outputs.
      norm_position: ``"post"`` or ``"pre"``.
      training: Whether dropout is active.

    Returns:
      ``(outputs (N, T, C), *extras)``.
    """
    outputs, *extras = sublayer(norm(inputs) if norm_position == "pre" else inputs)
    outputs = inputs + dropout(outputs, training=training)
    return (norm(outputs) if norm_position == "post" else outputs, *extras)


def attention_mask(query_mask, key_mask, causal_shape=None):
    """Boolean mask broadcastable to `(N, h, T_q, T_k)`, or None (all see all).

    The one place masks are combined: keys `(N, T_k)` (the same for every
    query) or `(N, T_q, T_k)` (keys per query), queries `(N, T_q)` (a hidden
    query sees no key), and causality (query ``i`` sees keys ``j <= i``) when
    `causal_shape` gives ``(T_q, T_k)``.
    """
    mask = None
    if key_mask is not None:
        key_mask = ops.cast(key_mask, "bool")
        mask = (key_mask[:, None, None, :] if len(key_mask.shape) == 2  # (N, 1, 1, T_k)
                else key_mask[:, None])  # (N, 1, T_q, T_k)
    if query_mask is not None:
        rows = ops.cast(query_mask, "bool")[:, None, :, None]  # (N, 1, T_q, 1)
        mask = rows if mask is None else ops.logical_and(mask, rows)
    if causal_shape is not None:
        future = causal_mask(*causal_shape)[None, None]  # (1, 1, T_q, T_k)
        mask = future if mask is None else ops.logical_and(mask, future)
    return mask


def project_heads(inputs, denses, num_heads, dtype):
    """`inputs` `(N, T, C_in)` through the `Dense` layers `denses`, split into heads.

    The one projection path of attention: a product by the denses' kernels
    side by side `(C_in, n*C)`, then the biases and the activation, as each
    `Dense` computes them (they share their options). Projections of one input
    thus read it once, in one wide matrix product instead of `n` narrow ones,
    and back-propagation gets its gradient from one product instead of
    summing `n` partial ones. The heads of each part are taken apart with one
    transpose, then views along the leading axis (splitting the last axis
    first would copy every element once more).

    Returns:
      `len(denses)` tensors `(N, h, T, d_k)`, in the compute `dtype`.
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
    x = ops.transpose(x, (2, 0, 3, 1, 4))  # (parts, N, h, T, d_k)
    return tuple(ops.unstack(x, parts, axis=0))


def merge_heads(heads):
    """Heads `(N, h, T, d_k)` side by side again: `(N, T, h*d_k)`."""
    width = heads.shape[1] * heads.shape[-1]
    heads = ops.transpose(heads, (0, 2, 1, 3))  # (N, T, h, d_k)
    return ops.reshape(heads, (ops.shape(heads)[0], ops.shape(heads)[1], width))


def _results(outputs, *optional):
    """`outputs` alone, or a tuple of it and those of `optional` that are not None."""
    given = tuple(value for value in optional if value is not None)
    return (outputs, *given) if given else outputs


@keras.saving.register_keras_serializable(package="kyu_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with residual connection and normalization.

    The original ``multihead_attention``: project queries/keys/values, split
    the projections into `num_heads` heads along the last axis (head ``h``
    owns columns ``h*d_k:(h+1)*d_k``), attend, concatenate the heads, add the
    queries back and normalize (`residual_connection`). With a `cache`, the
    same call decodes step by step.

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

    Call arguments:
      queries: `(N, T_q, C_q)`.
      keys: `(N, T_k, C_k)`; None (or `queries` itself) for self-attention.
      values: `(N, T_k, C_v)`; `keys` when None. Values of their own are
        always used, also when the keys are the queries.
      query_mask: Optional boolean `(N, T_q)`; default the Keras mask of
        `queries`. A masked query gets all-zero attention weights.
      key_mask: Optional boolean `(N, T_k)`, or `(N, T_q, T_k)` for keys per
        query; default the Keras mask of `keys` (of `queries` in
        self-attention; none with a `cache`). A masked key gets weight 0.
      training: Whether dropout is active.
      return_attention_scores: If True, also return the weights.
      cache: For step-by-step decoding, the projected keys and values so far,
        ``(k, v)`` `(N, h, T_c, d_k)` each. In self-attention this call's keys and
        values join them and it attends over the grown cache, which holds earlier
        positions only: `causality` gives way to `key_mask` (the slots each
        query sees). Over other keys the cache is their projection
        (`project_keys_values`, made once), used instead of `keys`.

    Returns:
      `(N, T_q, C_q)` outputs; then the weights `(N, h, T_q, T_k)` with
      `return_attention_scores`, the cache (grown in self-attention) with one.
    """

    def __init__(self, num_heads=8, num_units=None, dropout_rate=0.0, causality=False,
                 use_bias=True, projection_activation=None, output_projection=False,
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, residual_dropout_rate=0.0,
                 attention=None, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rate("dropout_rate", dropout_rate)
        _check_rate("residual_dropout_rate", residual_dropout_rate)
        if num_heads < 1:
            raise ValueError(f"`num_heads` must be positive, got {num_heads}.")
        if num_units is not None and num_units % num_heads:
            raise ValueError(f"`num_units` ({num_units}) must be divisible by `num_heads` "
                             f"({num_heads}).")
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
        if isinstance(attention, dict):
            attention = keras.saving.deserialize_keras_object(attention)
        self.attention = attention or ScaledDotProductAttention(self.dropout_rate)
        self.residual_dropout = Dropout(self.residual_dropout_rate)
        self.norm = Normalize(epsilon=self.epsilon, name="norm")
        self.supports_masking = True

    def build(self, queries_shape, keys_shape=None, values_shape=None):
        keys_shape = keys_shape or queries_shape
        values_shape = values_shape or keys_shape
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
        self.key_dense = projection("key_dense", keys_shape)
        self.value_dense = projection("value_dense", values_shape)
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
        if query_mask is None:
            query_mask = _keras_mask(queries)
        if key_mask is None and cache is None:
            key_mask = query_mask if self_attention else _keras_mask(keys)

        def attend(normalized):  # the sub-layer: (N, T_q, C_q), (N, h, T_q, T_k), cache
            q, k, v, grown = self._heads(normalized, None if self_attention else keys, values,
                                         cache)
            causal = self.causality and cache is None  # shapes read only then (loop nodes)
            mask = attention_mask(query_mask, key_mask,
                                  (ops.shape(q)[2], ops.shape(k)[2]) if causal else None)
            return (*self._attend_heads(q, k, v, mask), grown)

        outputs, weights, cache = residual_connection(
            queries, attend, self.norm, self.residual_dropout, self.norm_position, training)
        return _results(outputs, weights if return_attention_scores else None, cache)

    def _heads(self, queries, keys, values, cache):
        """``(q, k, v, cache)``: the heads `call` attends with, `(N, h, T, d_k)` each.

        `queries` as normalized by `call`; `keys` None in self-attention.
        """
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
            k = ops.concatenate([cache[0], ops.cast(k, cache[0].dtype)], axis=2)
            v = ops.concatenate([cache[1], ops.cast(v, cache[1].dtype)], axis=2)
            cache = (k, v)  # (N, h, T_c + T_q, d_k) each
        return q, k, v, cache

    def project_keys_values(self, keys, values=None):
        """Keys and values `(N, T_k, C)` -> per-head projections `(N, h, T_k, d_k)`.

        For step-by-step decoding, which projects a memory once (the `cache`
        of `call`). Without `values`, both projections of `keys` in one
        product; with `values` (even the same tensor), one product each: for
        the few rows of a decoding step, joining the kernels costs more than
        it saves.
        """
        if values is None:
            return self._project(keys, self.key_dense, self.value_dense)
        return self._project(keys, self.key_dense) + self._project(values, self.value_dense)

    def _project(self, inputs, *denses):
        return project_heads(inputs, denses, self.num_heads, self.compute_dtype)

    def _attend_heads(self, q, k, v, mask):
        """Attention per head, heads concatenated (and projected back): ``(outputs, weights)``."""
        heads, weights = self.attention(q, k, v, mask)  # (N, h, T_q, d_k), (N, h, T_q, T_k)
        outputs = merge_heads(heads)  # (N, T_q, C)
        return (self.output_dense(outputs) if self.output_projection else outputs), weights

    def compute_output_spec(self, queries, keys=None, values=None, query_mask=None,
                            key_mask=None, training=None, return_attention_scores=False,
                            cache=None):
        outputs = keras.KerasTensor(queries.shape, dtype=self.compute_dtype)
        num_keys = (keys if keys is not None else queries).shape[1]
        weights = keras.KerasTensor(
            (queries.shape[0], self.num_heads, queries.shape[1], num_keys),
            dtype=self.compute_dtype)
        return _results(outputs, weights if return_attention_scores else None, cache)

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
            attention=keras.saving.serialize_keras_object(self.attention))
        return config


# ----------------------------------------------------------------- feedforward


@keras.saving.register_keras_serializable(package="kyu_transformer")
class FeedForward(keras.layers.Layer):
    """Position-wise feed-forward net with residual and normalization.

    The original ``feedforward`` (two 1x1 convolutions, i.e. two `Dense`),
    wrapped as every sub-layer is (`residual_connection`): dropout, residual
    sum, norm.

    Args:
      num_units: ``(inner, outer)`` widths; `outer` must equal the input width.
      dropout_rate: Dropout on the output before the residual sum (training).
      activation: Activation of the inner layer.
      norm_position: ``"post"``: ``LN(x + FF(x))``; ``"pre"``: ``x + FF(LN(x))``.
      epsilon: Epsilon of the `Normalize` layer (`norm`).

    Call arguments:
      inputs: `(N, T, C)`.
      training: Whether dropout is active.

    Returns:
      `(N, T, C)`.
    """

    def __init__(self, num_units=(2048, 512), dropout_rate=0.0, activation="relu",
                 norm_position="post", epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rate("dropout_rate", dropout_rate)
        if len(num_units) != 2 or min(num_units) < 1:
            raise ValueError(f"`num_units` must be two positive ints, got {num_units!r}.")
        self.num_units = tuple(int(units) for units in num_units)
        self.dropout_rate = float(dropout_rate)
        self.activation = keras.activations.get(activation)
        self.norm_position = norm_position
        self.epsilon = float(epsilon)
        self.inner_dense = keras.layers.Dense(self.num_units[0], activation=self.activation,
                                              name="inner_dense")
        self.outer_dense = keras.layers.Dense(self.num_units[1], name="outer_dense")
        self.dropout = Dropout(self.dropout_rate)
        self.norm = Normalize(epsilon=self.epsilon, name="norm")
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
        def net(x):  # the sub-layer, (N, T, C) -> (N, T, C)
            return (self.outer_dense(self.inner_dense(x)),)

        (outputs,) = residual_connection(inputs, net, self.norm, self.dropout,
                                         self.norm_position, training)
        return outputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            num_units=list(self.num_units), dropout_rate=self.dropout_rate,
            activation=keras.activations.serialize(self.activation),
            norm_position=self.norm_position, epsilon=self.epsilon)
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
    """What the encoder and decoder blocks share: sizes, dropout, norm position.

    The sub-layers are made when the block is built, under the fast-paths
    switch as it was when the block was made (`fast_paths`), as if made then.
    """

    def __init__(self, num_heads, d_ff, dropout_rate=0.0, norm_position="post",
                 epsilon=LAYER_NORM_EPSILON, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_rate("dropout_rate", dropout_rate)
        self.num_heads = int(num_heads)
        self.d_ff = int(d_ff)
        self.dropout_rate = float(dropout_rate)
        self.norm_position = norm_position
        self.epsilon = float(epsilon)
        self._fast_paths = fast.enabled()
        self.supports_masking = True

    def _attention(self, name, causality=False):
        with fast.enabled_as(self._fast_paths):
            return MultiHeadAttention(
                num_heads=self.num_heads, dropout_rate=self.dropout_rate, causality=causality,
                output_projection=True, norm_position=self.norm_position, epsilon=self.epsilon,
                residual_dropout_rate=self.dropout_rate, name=name)

    def _feed_forward(self, d_model):
        with fast.enabled_as(self._fast_paths):
            return FeedForward((self.d_ff, d_model), dropout_rate=self.dropout_rate,
                               norm_position=self.norm_position, epsilon=self.epsilon,
                               name="feed_forward")

    def compute_mask(self, inputs, previous_mask=None):
        return previous_mask

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads, d_ff=self.d_ff, dropout_rate=self.dropout_rate,
            norm_position=self.norm_position, epsilon=self.epsilon)
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
        x = self.self_attention(inputs, query_mask=mask, key_mask=mask, training=training)
        return self.feed_forward(x, training=training)  # (N, T, C)

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="kyu_transformer")
class DecoderBlock(_Block):
    """Causal self-attention, attention over the encoder memory, feed-forward.

    Each sub-layer is wrapped as in `EncoderBlock`. Training and step-by-step
    decoding run this same `call`: decoding passes a `cache` (from
    `init_cache`) and gets it back grown by the call's positions.

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
      cache: For decoding, ``{"self": (k, v), "cross": (k, v)}``: the
        self-attention's keys and values of the earlier positions, and the
        memory's, projected once (see `MultiHeadAttention`).
      self_attention_mask: With a `cache`, the cache slots each of the `T`
        queries sees, boolean `(N, T, T_c + T)` (this call's slots last):
        needed when `T` > 1, as which slots belong to which query is the
        search's to say (see `decoding.own_history`); one query sees them all.

    Returns:
      `(N, T, C)`; with `return_attention_scores` ``(outputs, weights,
      coverage)``; with a `cache` the grown cache comes last.

    Raises:
      ValueError: `T` > 1 with a `cache` and no `self_attention_mask`.
    """

    def build(self, inputs_shape, memory_shape=None):
        memory_shape = memory_shape or inputs_shape
        self.self_attention = self._attention("self_attention", causality=True)
        self.cross_attention = self._attention("cross_attention")
        self.feed_forward = self._feed_forward(inputs_shape[-1])
        self.self_attention.build(inputs_shape)
        self.cross_attention.build(inputs_shape, memory_shape)
        self.feed_forward.build(inputs_shape)

    def init_cache(self, memory):
        """The `cache` of a built block before the first position, for `memory` `(N, S, C_m)`.

        ``self``: no keys and values yet, `(N, h, 0, d_k)` each; ``cross``: the
        memory's keys and values `(N, h, S, d_k)`, projected once and shared by
        every position (and by all hypotheses of a sentence).
        """
        head_width = self.self_attention.key_dense.units // self.num_heads  # d_k
        empty = ops.zeros((ops.shape(memory)[0], self.num_heads, 0, head_width), memory.dtype)
        return {"self": (empty, empty),
                "cross": self.cross_attention.project_keys_values(memory)}

    def call(self, inputs, memory, mask=None, memory_mask=None, training=None,
             return_attention_scores=False, cache=None, self_attention_mask=None):
        if mask is None:
            mask = _keras_mask(inputs)
        if memory_mask is None:
            memory_mask = _keras_mask(memory)
        self_keys = mask
        if cache is not None:
            if self_attention_mask is None and inputs.shape[1] != 1:
                raise ValueError(
                    f"{inputs.shape[1]} queries per sentence need a `self_attention_mask`: "
                    "which cache slots belong to each is the search's to say")
            self_keys = self_attention_mask
        caches = cache or {}
        # The weights are asked for so that both calls return a tuple (with the cache last).
        x, _, *grown_self = self.self_attention(
            inputs, query_mask=mask, key_mask=self_keys, training=training,
            return_attention_scores=True, cache=caches.get("self"))  # (N, T, C)
        x, weights, *grown_cross = self.cross_attention(
            x, memory, query_mask=mask, key_mask=memory_mask, training=training,
            return_attention_scores=True, cache=caches.get("cross"))  # weights (N, h, T, S)
        x = self.feed_forward(x, training=training)
        coverage = ops.mean(weights, axis=1) if return_attention_scores else None  # (N, T, S)
        grown = None if cache is None else {"self": grown_self[0], "cross": grown_cross[0]}
        return _results(x, *((weights, coverage) if return_attention_scores else ()), grown)

    def compute_output_spec(self, inputs, memory, mask=None, memory_mask=None, training=None,
                            return_attention_scores=False, cache=None, self_attention_mask=None):
        outputs = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return _results(outputs, cache)
        batch, length, source_length = inputs.shape[0], inputs.shape[1], memory.shape[1]
        weights = keras.KerasTensor((batch, self.num_heads, length, source_length),
                                    dtype=self.compute_dtype)
        coverage = keras.KerasTensor((batch, length, source_length), dtype=self.compute_dtype)
        return _results(outputs, weights, coverage, cache)


# --------------------------------------------------------------------- dropout


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Dropout(keras.layers.Dropout):
    """Keras' ``Dropout``, by `fast_paths.dropout` (16-bit random draws) when the
    fast-paths switch was on as the layer was made (`fast_paths`).

    Sets inputs to zero with probability `rate` in training and scales the
    others by ``1 / (1 - rate)``, as Keras' layer, whose options and config it
    keeps. With a `noise_shape`, or the switch off, Keras' own implementation
    runs.

    Args:
      rate: Fraction of the inputs to drop, in [0, 1).
      noise_shape, seed: As Keras' ``Dropout``.

    Call arguments:
      inputs: Any floating-point tensor.
      training: Whether to drop (otherwise the identity).

    Returns:
      A tensor of the inputs' shape and dtype.
    """

    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
        super().__init__(rate, noise_shape=noise_shape, seed=seed,
                         **_without_saved_switch(kwargs))
        self.fast_paths = fast.enabled()

    def call(self, inputs, training=False):
        if self.fast_paths and training and self.rate > 0 and self.noise_shape is None:
            return fast.dropout(inputs, self.rate, self.seed_generator)
        return super().call(inputs, training=training)
