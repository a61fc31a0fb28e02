"""The encoder-decoder Transformer: built from sizes (keyword arguments or an hparams dict),
it maps token ids to logits. Id 0 is padding everywhere."""

import keras
from keras import ops

from kyu_transformer import fast_paths as fast
from kyu_transformer.layers import (
    LAYER_NORM_EPSILON,
    NORM_POSITIONS,
    DecoderBlock,
    Dropout,
    Embedding,
    EncoderBlock,
    Normalize,
    PositionalEncoding,
    _check_choice,
    _check_rates,
    _without_saved_switch,
)

# The model's own arguments; `from_hparams` picks these out of a larger dict.
MODEL_ARGUMENTS = (
    "vocab_size", "d_model", "d_ff", "num_blocks", "num_heads", "maxlen1", "maxlen2",
    "dropout_rate", "norm_position", "sinusoid", "share_embeddings", "epsilon",
    "attention_dropout", "relu_dropout", "word_dropout")


@keras.saving.register_keras_serializable(package="kyu_transformer")
class Transformer(keras.Model):
    """Encoder-decoder Transformer with tied output weights. Norms and dropouts take
    `kyu_transformer.fast_paths` if that switch is on when the model is made (same function).

    Args:
      vocab_size: Size of the (shared) vocabulary; id 0 is padding.
      d_model, d_ff: Model width; inner width of the feed-forward nets.
      num_blocks, num_heads: Encoder blocks (and as many decoder blocks); attention heads.
      maxlen1, maxlen2: Longest source and target sequences (sizes of the position tables).
      dropout_rate: Dropout after the embeddings, on sub-layer outputs (and attention weights).
      norm_position: ``"post"`` (the original) or ``"pre"`` (adds a final norm to each stack).
      sinusoid: Fixed sinusoid (True) or learned (False) positions.
      share_embeddings: One table for source, target and logits (True), or a separate source one.
      epsilon: Epsilon of every normalization.
      attention_dropout: Dropout on the attention weights; None or negative: `dropout_rate`.
      relu_dropout: Dropout on the feed-forward nets' inner activations.
      word_dropout: Dropout of whole token embeddings (before the positions), on both sides.

    Call arguments:
      inputs: ``{"source": ids (N, S), "target_in": ids (N, T)}``, the target shifted right
        (starting with BOS); training: whether dropout is active.

    Returns:
      Logits `(N, T, vocab_size)` in the compute dtype.
    """

    def __init__(self, vocab_size, d_model=512, d_ff=2048, num_blocks=6, num_heads=8,
                 maxlen1=100, maxlen2=100, dropout_rate=0.1, norm_position="post",
                 sinusoid=True, share_embeddings=True, epsilon=LAYER_NORM_EPSILON,
                 attention_dropout=None, relu_dropout=0.0, word_dropout=0.0, **kwargs):
        super().__init__(**_without_saved_switch(kwargs))
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        if attention_dropout is None or attention_dropout < 0:
            attention_dropout = dropout_rate
        _check_rates(dropout_rate=dropout_rate, attention_dropout=attention_dropout,
                     relu_dropout=relu_dropout, word_dropout=word_dropout)
        if d_model % num_heads:
            raise ValueError(
                f"`d_model` ({d_model}) must be divisible by `num_heads` ({num_heads}).")
        self.vocab_size, self.d_model, self.d_ff = int(vocab_size), int(d_model), int(d_ff)
        self.num_blocks, self.num_heads = int(num_blocks), int(num_heads)
        self.maxlen1, self.maxlen2 = int(maxlen1), int(maxlen2)
        self.dropout_rate, self.norm_position = float(dropout_rate), norm_position
        self.sinusoid, self.share_embeddings = bool(sinusoid), bool(share_embeddings)
        self.epsilon, self.word_dropout = float(epsilon), float(word_dropout)
        self.attention_dropout, self.relu_dropout = float(attention_dropout), float(relu_dropout)

        self.target_embedding = Embedding(vocab_size, d_model, name="target_embedding")
        self.source_embedding = (self.target_embedding if share_embeddings
                                 else Embedding(vocab_size, d_model, name="source_embedding"))
        self.source_positions = PositionalEncoding(maxlen1, d_model, sinusoid=sinusoid,
                                                   name="source_positions")
        self.target_positions = PositionalEncoding(maxlen2, d_model, sinusoid=sinusoid,
                                                   name="target_positions")
        self.source_dropout = Dropout(dropout_rate)
        self.target_dropout = Dropout(dropout_rate)
        args = dict(num_heads=num_heads, d_ff=d_ff, dropout_rate=dropout_rate,
                    norm_position=norm_position, epsilon=epsilon,
                    attention_dropout_rate=self.attention_dropout,
                    inner_dropout_rate=self.relu_dropout)
        self.encoder_blocks = [EncoderBlock(**args, name=f"encoder_{i}") for i in range(num_blocks)]
        self.decoder_blocks = [DecoderBlock(**args, name=f"decoder_{i}") for i in range(num_blocks)]
        if norm_position == "pre":  # pre-norm stacks leave their last residual sum unnormalized
            self.encoder_norm = Normalize(epsilon, name="encoder_norm")
            self.decoder_norm = Normalize(epsilon, name="decoder_norm")
        # Made last: at rate 0 they have no random state, and the others keep their order.
        self.source_word_dropout = Dropout(self.word_dropout, noise_shape=(None, None, 1))
        self.target_word_dropout = Dropout(self.word_dropout, noise_shape=(None, None, 1))

    @classmethod
    def from_hparams(cls, hparams, **kwargs):
        """The model of a dict with `MODEL_ARGUMENTS`, under its ``fast_paths`` (default on)."""
        with fast.enabled_as(hparams.get("fast_paths", True)):
            return cls(**{key: hparams[key] for key in MODEL_ARGUMENTS if key in hparams},
                       **kwargs)

    def build(self, input_shape=None):
        # Run once on dummy ids so that every weight exists (e.g. before loading).
        dummy = ops.ones((1, 2), dtype="int32")
        self.call({"source": dummy, "target_in": dummy})

    def _embed(self, ids, embedding, positions, dropouts, training, table=None):
        word_dropout, dropout = dropouts
        x = word_dropout(embedding(ids, table=table), training=training)  # (N, L, C)
        return dropout(x + positions(ids), training=training)

    def encode(self, source, training=None, table=None):
        """Source ids `(N, S)` -> ``(memory (N, S, C), source_mask (N, S))``; `table`: the
        source embedding's `table()`, if already made."""
        source_mask = ops.not_equal(source, 0)  # (N, S)
        x = self._embed(source, self.source_embedding, self.source_positions,
                        (self.source_word_dropout, self.source_dropout), training, table)
        for block in self.encoder_blocks:
            x = block(x, mask=source_mask, training=training)
        return (self.encoder_norm(x) if self.norm_position == "pre" else x), source_mask

    def decode(self, target_in, memory, source_mask, training=None,
               return_attention_scores=False, table=None):
        """Target ids `(N, T)` and the encoder's output -> logits `(N, T, V)`, plus with
        `return_attention_scores` the last block's head-averaged cross-attention `(N, T, S)`."""
        if table is None:
            table = self.target_embedding.table()  # (V, C), for the inputs and the logits
        target_mask = ops.not_equal(target_in, 0)  # (N, T)
        x = self._embed(target_in, self.target_embedding, self.target_positions,
                        (self.target_word_dropout, self.target_dropout), training, table)
        coverage = None
        for block in self.decoder_blocks:
            x, _, coverage = block(x, memory, mask=target_mask, memory_mask=source_mask,
                                   training=training, return_attention_scores=True)
        x = self.decoder_norm(x) if self.norm_position == "pre" else x
        logits = self.target_embedding.attend(x, table=table)
        return (logits, coverage) if return_attention_scores else logits  # (N, T, V)

    def init_cache(self, memory, source_mask):
        """The decoding state before the first position: ``blocks`` (per block its
        `DecoderBlock.init_cache`), ``memory``, ``source_mask`` and ``target_table`` (the
        target table in the compute dtype, cast once, not every step)."""
        if not self.built:
            self.build()
        return {"blocks": [block.init_cache(memory) for block in self.decoder_blocks],
                "memory": memory, "source_mask": source_mask,
                "target_table": self.target_embedding.table()}  # (V, C)

    def decode_step(self, token_ids, position, cache, self_mask=None):
        """Logits of the next token after `token_ids` `(N,)` (or `(N, K)`: `K` hypotheses per
        sentence) at index `position`, with the `cache` of `init_cache` or the previous step;
        `self_mask` `(N, K, T + K)`, for `K` > 1: the cache slots each hypothesis sees.

        Returns ``(logits (N, [K,] V), the grown cache, coverage (N, [K,] S))``, the coverage
        being the last block's cross-attention averaged over heads.
        """
        single = len(token_ids.shape) == 1
        if single:
            token_ids = token_ids[:, None]  # (N, 1)
        x = self.target_embedding(token_ids, table=cache["target_table"])  # (N, K, C)
        x = x + self.target_positions.encoding_at(position)[None]
        blocks = []
        for index, (block, block_cache) in enumerate(zip(self.decoder_blocks, cache["blocks"])):
            last = index == len(self.decoder_blocks) - 1  # the coverage is the last block's
            x, *coverage, block_cache = block(
                x, cache["memory"], memory_mask=cache["source_mask"], cache=block_cache,
                self_attention_mask=self_mask, return_attention_scores=last)
            blocks.append(block_cache)
        x = self.decoder_norm(x) if self.norm_position == "pre" else x
        logits = self.target_embedding.attend(x, table=cache["target_table"])  # (N, K, V)
        coverage = coverage[-1]  # (N, K, S)
        if single:
            logits, coverage = logits[:, 0], coverage[:, 0]
        return logits, {**cache, "blocks": blocks}, coverage

    def call(self, inputs, training=None):
        # A shared table is cast and masked once for its three uses, not each time.
        table = self.target_embedding.table() if self.share_embeddings else None
        memory, source_mask = self.encode(inputs["source"], training=training, table=table)
        return self.decode(inputs["target_in"], memory, source_mask, training=training,
                           table=table)

    def get_config(self):
        return {**super().get_config(), **{key: getattr(self, key) for key in MODEL_ARGUMENTS}}
