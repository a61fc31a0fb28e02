"""Decoding speed (sentences/s) on Multi30k test_2016_flickr: ours against keras-hub, in one run.

    python benchmarks/decode_speed.py [--repeats 3] [--sentences 1000]

Every model has the benchmark size of the training benchmark (d_model 256,
d_ff 1024, 3+3 blocks, 4 heads, vocabulary 8000) and RANDOM weights, so no
sentence stops early: every method decodes exactly --max_length tokens for
every sentence, on the same batches (sources sorted by length, --batch_size
sentences). Methods:

- ours, greedy with the key/value cache (`search` with `GreedySearch`);
- ours, greedy recomputing the whole prefix each step (`recompute_greedy_search`,
  compiled the same way);
- ours, beam 4 with the cache (`search` with `BeamSearch`);
- keras-hub's `GreedySampler` and `BeamSampler(num_beams=4)` driving a model
  built from keras-hub's `TransformerEncoder`/`TransformerDecoder` with their
  own caches, compiled with XLA as keras-hub's `generate` does.

Prints each repetition, medians and the ratios. Needs `pip install -e .[bench]`.
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

from prerequisites import DEFAULT_DATA, require, require_data  # noqa: E402

from kyu_transformer.conventions import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,  # noqa: E402
)
from kyu_transformer.data.subwords import Subwords  # noqa: E402
from kyu_transformer.data.text import load_split  # noqa: E402
from kyu_transformer.decoding.search import BeamSearch, GreedySearch, search  # noqa: E402
from kyu_transformer.model import Transformer  # noqa: E402

SHAPE = dict(vocab_size=8000, d_model=256, d_ff=1024, num_blocks=3, num_heads=4)


class KerasHubTranslator:
    """A keras-hub encoder-decoder of the benchmark size, decoded by keras-hub samplers."""

    def __init__(self, max_length, source_length=128):
        import keras_hub

        layers = keras_hub.layers
        self.max_length = max_length
        self.embedding = layers.ReversibleEmbedding(SHAPE["vocab_size"], SHAPE["d_model"])
        self.source_positions = layers.PositionEmbedding(source_length)
        self.target_positions = layers.PositionEmbedding(max_length + 1)
        self.encoders = [layers.TransformerEncoder(SHAPE["d_ff"], SHAPE["num_heads"])
                         for _ in range(SHAPE["num_blocks"])]
        self.decoders = [layers.TransformerDecoder(SHAPE["d_ff"], SHAPE["num_heads"])
                         for _ in range(SHAPE["num_blocks"])]
        self.samplers = {"greedy": keras_hub.samplers.GreedySampler(),
                         "beam4": keras_hub.samplers.BeamSampler(num_beams=4)}

    def encode(self, source):
        x = self.embedding(source)
        x = x + self.source_positions(x)
        for layer in self.encoders:
            x = layer(x, padding_mask=ops.not_equal(source, 0))
        return x

    def decode_with_cache(self, memory, memory_mask, tokens, self_cache, index, cross_cache,
                          cross_index):
        x = self.embedding(tokens)
        x = x + self.target_positions(x, start_index=index)
        self_caches, cross_caches = [], []
        for i, layer in enumerate(self.decoders):
            x, layer_self, layer_cross = layer(
                decoder_sequence=x, encoder_sequence=memory, encoder_padding_mask=memory_mask,
                self_attention_cache=self_cache[:, i], self_attention_cache_update_index=index,
                cross_attention_cache=cross_cache[:, i],
                cross_attention_cache_update_index=cross_index)
            self_caches.append(layer_self)
            cross_caches.append(layer_cross)
        cross = ops.stack(cross_caches, axis=1) if cross_index is not None else cross_cache
        return self.embedding(x, reverse=True), x, ops.stack(self_caches, axis=1), cross

    def generate(self, source, method):
        batch = ops.shape(source)[0]
        memory_mask = ops.not_equal(source, 0)
        memory = self.encode(source)
        head = SHAPE["d_model"] // SHAPE["num_heads"]
        layers_ = SHAPE["num_blocks"]
        length = self.max_length + 1
        self_cache = ops.zeros((batch, layers_, 2, length, SHAPE["num_heads"], head))
        cross_cache = ops.zeros((batch, layers_, 2, ops.shape(source)[1], SHAPE["num_heads"],
                                 head))
        prompt = ops.concatenate([ops.full((batch, 1), BOS_ID, "int32"),
                                  ops.zeros((batch, self.max_length), "int32")], axis=1)
        _, hidden, self_cache, cross_cache = self.decode_with_cache(
            memory, memory_mask, prompt[:, :1], self_cache, 0, cross_cache, 0)

        def next(prompt, cache, index):
            self_cache, memory, memory_mask, cross_cache = cache
            token = ops.slice(prompt, [0, index - 1], [ops.shape(prompt)[0], 1])
            logits, hidden, self_cache, _ = self.decode_with_cache(
                memory, memory_mask, token, self_cache, index - 1, cross_cache, None)
            return (ops.squeeze(logits, 1), ops.squeeze(hidden, 1),
                    (self_cache, memory, memory_mask, cross_cache))

        mask = ops.concatenate([ops.ones((batch, 1), "bool"),
                                ops.zeros((batch, self.max_length), "bool")], axis=1)
        return self.samplers[method](next=next, prompt=prompt,
                                     cache=(self_cache, memory, memory_mask, cross_cache),
                                     index=1, mask=mask, stop_token_ids=[EOS_ID],
                                     hidden_states=hidden)


def recompute_greedy_search(model, source, max_length):
    """Greedy search without a cache: the whole prefix is decoded again each step.

    The baseline that the cache is measured against (and checked by): same
    outputs as the cached greedy search, cost growing with the square of the length.
    """
    memory, source_mask = model.encode(source, training=False)
    batch = ops.shape(source)[0]
    # Column 0 holds BOS; step t decodes columns 0..t and writes column t + 1.
    prefix = ops.concatenate([ops.full((batch, 1), BOS_ID, "int32"),
                              ops.zeros((batch, max_length), "int32")], axis=1)
    finished = ops.zeros((batch,), "bool")

    def unfinished(step, *_):
        return step < max_length

    def body(step, prefix, finished):
        logits = model.decode(prefix[:, :step + 1], memory, source_mask, training=False)
        chosen = ops.cast(ops.argmax(logits[:, -1], axis=-1), "int32")
        chosen = ops.where(finished, PAD_ID, chosen)
        prefix = ops.slice_update(prefix, (0, step + 1), chosen[:, None])
        finished = ops.logical_or(finished, ops.equal(chosen, EOS_ID))
        return ops.where(ops.all(finished), max_length, step + 1), prefix, finished

    _, prefix, _ = ops.while_loop(unfinished, body, (0, prefix, finished))
    return prefix[:, 1:]


def batches_of(sources, batch_size):
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    batches = []
    for first in range(0, len(order), batch_size):
        rows = [sources[i] for i in order[first:first + batch_size]]
        width = max(len(r) for r in rows)
        batches.append(np.array([r + [0] * (width - len(r)) for r in rows], dtype="int32"))
    return batches


def measure(name, function, batches, repeats):
    for batch in batches:  # compile every shape once, untimed
        np.asarray(function(tf.constant(batch)))
    rates = []
    sentences = sum(len(b) for b in batches)
    for repeat in range(repeats):
        started = time.perf_counter()
        for batch in batches:
            np.asarray(function(tf.constant(batch)))
        seconds = time.perf_counter() - started
        rates.append(sentences / seconds)
        print(f"  {name:22s} repeat {repeat + 1}: {rates[-1]:7.1f} sentences/s ({seconds:.1f} s)",
              flush=True)
    return statistics.median(rates)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=DEFAULT_DATA)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--max_length", type=int, default=48,
                        help="tokens decoded per sentence (random weights never stop early)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip_peer", action="store_true")
    parser.add_argument("--skip_recompute", action="store_true")
    return parser.parse_args()


def flickr_batches(args):
    """Returns the first --sentences of test_2016_flickr, encoded (EOS ended) with a subword
    model of the training split, in batches of --batch_size."""
    train_sources, train_targets, _ = load_split(args.data_dir, "train")
    subwords = Subwords.train_or_load(tempfile.mkdtemp(), train_sources + train_targets,
                                      SHAPE["vocab_size"])
    sources, _, _ = load_split(args.data_dir, "test_2016_flickr")
    encoded = [ids + [EOS_ID] for ids in subwords.encode(sources[:args.sentences])]
    batches = batches_of(encoded, args.batch_size)
    print(f"{len(encoded)} sentences of test_2016_flickr in {len(batches)} batches; random "
          f"weights; {args.max_length} tokens decoded per sentence", flush=True)
    return batches


def time_ours(batches, args):
    """Returns the median sentences/s of our searches (cached greedy, recomputing greedy
    unless --skip_recompute, cached beam 4) of a model with random weights."""
    keras.utils.set_random_seed(0)
    model = Transformer(**SHAPE, maxlen1=128, maxlen2=args.max_length, dropout_rate=0.0)
    model.build()
    length = args.max_length
    methods = {
        "ours greedy, cache":
            lambda s: search(model, s, length, GreedySearch(alpha=0.0, scores=False)).ids[:, 0],
        "ours greedy, recompute": lambda s: recompute_greedy_search(model, s, length),
        "ours beam 4, cache": lambda s: search(model, s, length, BeamSearch(4, 0.6)).ids,
    }
    if args.skip_recompute:
        del methods["ours greedy, recompute"]
    return {name: measure(name, tf.function(method), batches, args.repeats)
            for name, method in methods.items()}


def main():
    args = parse_args()
    if not args.skip_peer:
        require("keras_hub")
    require_data(args.data_dir)
    batches = flickr_batches(args)
    results = time_ours(batches, args)
    if not args.skip_peer:
        peer = KerasHubTranslator(args.max_length)
        for method in ("greedy", "beam4"):
            function = tf.function(lambda s, m=method: peer.generate(s, m), jit_compile=True)
            results[f"keras-hub {method}"] = measure(f"keras-hub {method}", function, batches,
                                                     args.repeats)
    print("\nmedians (sentences/s):")
    for name, rate in results.items():
        print(f"  {name:22s} {rate:7.1f}")
    ratios = [("ours greedy, cache", "ours greedy, recompute"),
              ("ours greedy, cache", "keras-hub greedy"),
              ("ours beam 4, cache", "keras-hub beam4")]
    for ours, other in ratios:
        if ours in results and other in results:
            print(f"ratio {ours} / {other}: {results[ours] / results[other]:.2f}x")


if __name__ == "__main__":
    main()
