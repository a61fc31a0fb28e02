"""Defines the encoder-decoder Transformer, which is built from sizes (keyword arguments or an
hparams dict) and maps token ids to logits. `PAD_ID` is padding everywhere."""

import inspect

import keras
from keras import ops

from kyu_transformer.conventions import (
    LAYER_NORM_EPSILON, NORM_POSITIONS, NORM_TYPES, PAD_ID, check_choice, check_heads,
    check_rates)
from kyu_transformer.layers import (
    DecoderBlock, Dropout, Embedding, EncoderBlock, LayerDrop, PositionalEncoding,
    embedding_initializer, make_norm, set_fast_paths)


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Transformer(keras.Model):
    """Maps source ids and target ids to the logits of the next target tokens: an
    encoder-decoder Transformer whose output layer is its target embedding. Its norms and
    dropouts take `kyu_transformer.fast_paths` if that switch is on when the model is made.

    Args:
      vocab_size: Size of the (shared) vocabulary; `PAD_ID` is padding.
      d_model, d_ff: Model width; inner width of the feed-forward nets.
      num_blocks, num_heads: Encoder blocks (and as many decoder blocks); attention heads.
      maxlen1, maxlen2: Longest source and target sequences (sizes of the position tables).
      dropout_rate: Dropout after the embeddings, on sub-layer outputs (and attention weights).
      norm_position: ``"post"`` (the original) or ``"pre"`` (adds a final norm to each stack).
      sinusoid: Fixed sinusoid (True) or learned (False) positions.
      share_embeddings: One table for source, target and logits (True), or a separate source one.
      epsilon: Epsilon of every normalization.
      attention_dropout: Dropout on the attention weights; None: `dropout_rate`.
      relu_dropout: Dropout on the feed-forward nets' inner activations.
      word_dropout: Dropout of whole token embeddings (before the positions), on both sides.
      norm_type: ``"layer"`` (layer norm, the original) or ``"scale"`` (`ScaleNorm`), for every
        normalization.
      fix_norm: Every embedding row read at length 1 (`Embedding`'s `unit_norm`, FixNorm).
      layer_dropout: In training, each encoder and decoder block dropped whole with this
        probability (`LayerDrop`).
      embedding_init: How the embedding tables start: ``"glorot"`` (the original) or
        ``"normal"`` (standard deviation ``1 / sqrt(d_model)``; `EMBEDDING_INITS`).

    Call arguments:
      inputs: ``{"source": ids (N, S), "target_in": ids (N, T)}``, the target shifted right
        (starting with BOS); training: whether dropout is active.

    Returns:
      Logits `(N, T, vocab_size)` in the compute dtype.
    """

    def __init__(self, vocab_size, d_model=512, d_ff=2048, num_blocks=6, num_heads=8,
                 maxlen1=100, maxlen2=100, dropout_rate=0.1, norm_position="post",
                 sinusoid=True, share_embeddings=True, epsilon=LAYER_NORM_EPSILON,
                 attention_dropout=None, relu_dropout=0.0, word_dropout=0.0, norm_type="layer",
                 fix_norm=False, layer_dropout=0.0, embedding_init="glorot", **kwargs):
        super().__init__(**kwargs)
        check_choice("norm_position", norm_position, NORM_POSITIONS)
        check_choice("norm_type", norm_type, NORM_TYPES)
        attention_dropout = dropout_rate if attention_dropout is None else attention_dropout
        check_rates(dropout_rate=dropout_rate, attention_dropout=attention_dropout,
                    relu_dropout=relu_dropout, word_dropout=word_dropout,
                    layer_dropout=layer_dropout)
        check_heads(d_model, num_heads)
        self.vocab_size, self.d_model, self.d_ff = int(vocab_size), int(d_model), int(d_ff)
        self.num_blocks, self.num_heads = int(num_blocks), int(num_heads)
        self.maxlen1, self.maxlen2 = int(maxlen1), int(maxlen2)
        self.dropout_rate, self.norm_position = float(dropout_rate), norm_position
        self.sinusoid, self.share_embeddings = bool(sinusoid), bool(share_embeddings)
        self.epsilon, self.word_dropout = float(epsilon), float(word_dropout)
        self.attention_dropout, self.relu_dropout = float(attention_dropout), float(relu_dropout)
        self.norm_type, self.fix_norm = norm_type, bool(fix_norm)
        self.layer_dropout, self.embedding_init = float(layer_dropout), embedding_init
        self.target_embedding = Embedding(
            vocab_size, d_model, embedding_initializer(embedding_init, d_model),
            unit_norm=fix_norm, name="target_embedding")
        self.source_embedding = self.target_embedding if share_embeddings else Embedding(
            vocab_size, d_model, embedding_initializer(embedding_init, d_model),
            unit_norm=fix_norm, name="source_embedding")
        self.source_positions = PositionalEncoding(maxlen1, d_model, sinusoid=sinusoid,
                                                   name="source_positions")
        self.target_positions = PositionalEncoding(maxlen2, d_model, sinusoid=sinusoid,
                                                   name="target_positions")
        self.source_word_dropout = Dropout(self.word_dropout, noise_shape=(None, None, 1))
        self.target_word_dropout = Dropout(self.word_dropout, noise_shape=(None, None, 1))
        self.source_dropout, self.target_dropout = Dropout(dropout_rate), Dropout(dropout_rate)
        args = dict(num_heads=num_heads, d_ff=d_ff, dropout_rate=dropout_rate,
                    norm_position=norm_position, epsilon=epsilon,
                    attention_dropout_rate=self.attention_dropout,
                    inner_dropout_rate=self.relu_dropout, norm_type=norm_type)
        self.encoder_blocks = [EncoderBlock(**args, name=f"encoder_{i}") for i in range(num_blocks)]
        self.decoder_blocks = [DecoderBlock(**args, name=f"decoder_{i}") for i in range(num_blocks)]
        # A pre-norm stack leaves its last residual sum unnormalized: it ends with a norm.
        pre_norm = norm_position == "pre"
        self.encoder_norm = make_norm(norm_type, epsilon, "encoder_norm") if pre_norm else None
        self.decoder_norm = make_norm(norm_type, epsilon, "decoder_norm") if pre_norm else None
        # Made only when used: a model without it has the layers and random draws it had. (On,
        # as any dropout turned on, its seed is drawn before the blocks' weights and masks are:
        # those start otherwise for the same seed.)
        self.layer_drop = LayerDrop(layer_dropout, name="layer_drop") if layer_dropout else None

    @classmethod
    def from_hparams(cls, hparams, **kwargs):
        """Makes the model of an hparams dict: of its keys those that name an argument of the
        model, and its ``fast_paths`` (default on) as the switch of the norms and dropouts."""
        arguments = {key: hparams[key] for key in _argument_names(cls) if key in hparams}
        # hparams.json spells "the attention dropout is `dropout_rate`" -1 (a JSON number),
        # the model None.
        if arguments.get("attention_dropout") == -1:
            arguments["attention_dropout"] = None
        return set_fast_paths(cls(**arguments, **kwargs), hparams.get("fast_paths", True))

    def build(self, input_shape=None):
        # Run once on dummy ids so that every weight exists (e.g. before loading).
        dummy = ops.ones((1, 2), dtype="int32")
        self.call({"source": dummy, "target_in": dummy})

    def _embed(self, ids, embedding, positions, dropouts, training, table=None):
        word_dropout, dropout = dropouts
        x = word_dropout(embedding(ids, table=table), training=training)  # (N, L, C)
        return dropout(x + positions(ids), training=training)

    def encode(self, source, training=None, table=None):
        """Encodes source ids `(N, S)`; returns ``(memory (N, S, C), source_mask (N, S))``.
        `table`: the source embedding's `table()`, if already made."""
        source_mask = ops.not_equal(source, PAD_ID)  # (N, S)
        x = self._embed(source, self.source_embedding, self.source_positions,
                        (self.source_word_dropout, self.source_dropout), training, table)
        for block in self.encoder_blocks:
            x = _dropped(self.layer_drop, x, block(x, mask=source_mask, training=training),
                         training)
        return _final_norm(self.encoder_norm, x), source_mask

    def decode(self, target_in, memory, source_mask, training=None,
               return_attention_scores=False, table=None):
        """Returns the logits `(N, T, V)` of target ids `(N, T)` over the encoder's output,
        and with `return_attention_scores` the last block's cross-attention averaged over
        heads `(N, T, S)`."""
        if table is None:
            table = self.target_embedding.table()  # (V, C), for the inputs and the logits
        target_mask = ops.not_equal(target_in, PAD_ID)  # (N, T)
        x = self._embed(target_in, self.target_embedding, self.target_positions,
                        (self.target_word_dropout, self.target_dropout), training, table)
        logits, coverage, _ = self._decoder_stack(x, memory, source_mask, table,
                                                  target_mask=target_mask, training=training)
        return (logits, coverage) if return_attention_scores else logits  # (N, T, V)

    def init_cache(self, memory, source_mask):
        """Returns the decoding state before the first position: ``blocks`` (per block its
        `DecoderBlock.init_cache`), ``memory``, ``source_mask`` and ``target_table`` (the
        target table in the compute dtype, cast once, not every step)."""
        if not self.built:
            self.build()
        return {"blocks": [block.init_cache(memory) for block in self.decoder_blocks],
                "memory": memory, "source_mask": source_mask,
                "target_table": self.target_embedding.table()}  # (V, C)

    def decode_step(self, token_ids, position, cache, self_mask=None):
        """Computes the logits of the next token after `token_ids` `(N,)` (or `(N, K)`: `K`
        hypotheses per sentence) at index `position`, with the `cache` of `init_cache` or the
        previous step; `self_mask` `(N, K, T + K)`, for `K` > 1: the cache slots each
        hypothesis sees.

        Returns ``(logits (N, [K,] V), the grown cache, coverage (N, [K,] S))``, the coverage
        being the last block's cross-attention averaged over heads.
        """
        single = len(token_ids.shape) == 1
        if single:
            token_ids = token_ids[:, None]  # (N, 1)
        x = self.target_embedding(token_ids, table=cache["target_table"])  # (N, K, C)
        x = x + self.target_positions.encoding_at(position)[None]
        logits, coverage, blocks = self._decoder_stack(
            x, cache["memory"], cache["source_mask"], cache["target_table"],
            caches=cache["blocks"], self_mask=self_mask)  # (N, K, V), (N, K, S)
        if single:
            logits, coverage = logits[:, 0], coverage[:, 0]
        return logits, {**cache, "blocks": blocks}, coverage

    def _decoder_stack(self, x, memory, source_mask, table, target_mask=None, training=None,
                       caches=None, self_mask=None):
        """Runs the decoder blocks over embedded targets `x` `(N, T, C)`, then the final norm
        and the output layer.

        Returns ``(logits (N, T, V), coverage (N, T, S), caches)``: the coverage is the last
        block's cross-attention averaged over heads; `caches` (one per block, when given) come
        back grown, else the list is empty.
        """
        coverage, grown = None, []  # None: a stack without blocks
        for index, block in enumerate(self.decoder_blocks):
            last = index == len(self.decoder_blocks) - 1  # only its mean over heads is needed
            results = block(
                x, memory, mask=target_mask, memory_mask=source_mask, training=training,
                return_attention_scores=last, cache=None if caches is None else caches[index],
                self_attention_mask=self_mask)
            results = results if isinstance(results, tuple) else (results,)
            if caches is not None:
                *results, cache = results
                grown.append(cache)
            outputs, *attention = results
            x = _dropped(self.layer_drop, x, outputs, training)
            coverage = attention[-1] if attention else coverage
        logits = self.target_embedding.attend(_final_norm(self.decoder_norm, x), table=table)
        return logits, coverage, grown

    def call(self, inputs, training=None):
        # A shared table is cast and masked once for its three uses, not each time.
        table = self.target_embedding.table() if self.share_embeddings else None
        memory, source_mask = self.encode(inputs["source"], training=training, table=table)
        return self.decode(inputs["target_in"], memory, source_mask, training=training,
                           table=table)

    def get_config(self):
        return {**super().get_config(),
                **{name: getattr(self, name) for name in _argument_names(type(self))}}


def _dropped(layer_drop, inputs, outputs, training):
    """Returns a block's `outputs`, or with a `LayerDrop` (in training) at times its `inputs`."""
    return outputs if layer_drop is None else layer_drop(inputs, outputs, training=training)


def _final_norm(norm, x):
    """Returns `x` through a stack's final norm, which only a pre-norm stack has (else None)."""
    return x if norm is None else norm(x)


def _argument_names(model_class):
    """Returns the names of the arguments `model_class` takes besides ``**kwargs``: those that
    `from_hparams` picks out of an hparams dict and `get_config` returns."""
    parameters = list(inspect.signature(model_class.__init__).parameters.values())[1:]  # self
    return [parameter.name for parameter in parameters
            if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
