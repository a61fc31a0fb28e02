"""A logdir whose model has set weights: outputs that vary and often run to their limit.

The search, export and engine tests need a model whose greedy and beam outputs
differ from sentence to sentence, some ending with EOS and many reaching their
length limit. A model trained for a few hundred steps gives that only by luck
of its training run, which ends elsewhere on another processor (its kernels
round differently). The weights here are set instead: seeded uniform values
(numpy's generator draws the same numbers on every machine), scaled so that

- the decoder does not echo its input: with tied embeddings, an input
  embedding that dominates the residual sum makes the last token the likeliest
  next one, so the embeddings are small and the sub-layers' projections large
  (3 times a unit-variance start): what the cross-attention brings from the
  source then decides the output;
- the logits are peaked, as a trained model's are (the last normalization's
  gain), so that beam search does not favour the shortest outputs;
- EOS wins now and then: its row is scaled up, so that about half of the
  greedy outputs end before a limit of 16 tokens beyond the source and the
  rest reach it (`check_varied_outputs` states what the tests rely on).

Only rounding separates two machines' outputs then, which moves an argmax only
where two logits tie to the last bits. How often EOS wins depends on the draw,
though, so the seed (0) is part of the construction: most other seeds run nearly
every output to its limit, which `check_varied_outputs` refuses (the figures of
seeds 0 to 9: benchmarks/RESULTS.md, "Test suite").
"""

import os

import numpy as np
import tensorflow as tf

import hparams as hp
from kyu_transformer import config
from kyu_transformer.conventions import EOS_ID, PAD_ID
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import load_split
from kyu_transformer.model import Transformer
from kyu_transformer.training.checkpoints import checkpoint_dir, model_weights

EMBEDDING_SCALE = 0.1  # half-width / sqrt(3) of the table's uniform values
SUBLAYER_GAIN = 3.0  # of every projection, against a unit-variance (fan-in) start
LOGIT_GAIN = 8.0  # gamma of the decoder's last normalization
EOS_SCALE = 1.6  # of the EOS embedding row
CHECKPOINT_STEPS = (100, 200, 300)  # three rolling checkpoints, for --average_last


def set_varied_weights(model, seed, jitter=0.0):
    """Sets every weight of a built post-norm `Transformer` with sinusoid positions, as the
    module docstring says.

    `jitter`: relative noise of a second draw (seed + 1) on every weight, so
    that checkpoints of one logdir differ a little, as a run's do.
    """
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1)
    last_norm = f"decoder_{model.num_blocks - 1}/feed_forward/norm/gamma"
    values = []
    for path, variable in model_weights(model).items():
        shape = tuple(variable.shape)
        if path.endswith("gamma"):
            value = np.full(shape, LOGIT_GAIN if path == last_norm else 1.0)
        elif path.endswith("beta"):
            value = np.zeros(shape)
        elif path.endswith("embeddings"):
            value = rng.uniform(-1, 1, shape) * EMBEDDING_SCALE * np.sqrt(3.0)
            value[PAD_ID] = 0.0
            value[EOS_ID] *= EOS_SCALE
        elif path.endswith("bias"):
            value = rng.uniform(-0.1, 0.1, shape)
        else:  # a kernel (fan_in, fan_out)
            value = rng.uniform(-1, 1, shape) * np.sqrt(3.0 / shape[0]) * SUBLAYER_GAIN
        if jitter and not path.endswith(("gamma", "beta")):
            value = value * (1.0 + jitter * noise.uniform(-1, 1, shape))
        values.append(value.astype("float32"))
    for variable, value in zip(model_weights(model).values(), values):
        variable.assign(value)


def write_varied_logdir(logdir, data_dir, architecture, seed=0):
    """A logdir as eval.py and export.py read it: hparams.json, subwords, checkpoints.

    `architecture`: hparams that change the `tiny` preset's model (a post-norm one).

    The subword model is trained on `data_dir`'s training split (both sides),
    as train.py does. The checkpoints (`CHECKPOINT_STEPS`) hold the weights of
    `set_varied_weights(seed)`, the first jittered by 1%, the second by 2%, the last not.
    """
    logdir = str(logdir)
    hparams = hp.parse("tiny", {**architecture, "data_dir": data_dir, "logdir": logdir})
    sources, targets, _ = load_split(data_dir, "train")
    subwords = Subwords.train_or_load(logdir, sources + targets, hparams["vocab_size"],
                                      hparams["subword_model_type"])
    assert subwords.vocab_size == hparams["vocab_size"], subwords.vocab_size
    config.save(hparams, os.path.join(logdir, "hparams.json"))
    model = Transformer.from_hparams(hparams, name="transformer")
    model.build()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(weights=model_weights(model)),
                                         checkpoint_dir(logdir),
                                         max_to_keep=len(CHECKPOINT_STEPS))
    for index, step in enumerate(CHECKPOINT_STEPS):
        last = index == len(CHECKPOINT_STEPS) - 1
        set_varied_weights(model, seed, jitter=0.0 if last else 0.01 * (index + 1))
        manager.save(checkpoint_number=step)
    return logdir


def varied_figures(model, sources):
    """``(distinct, cut)``: how many greedy outputs of `sources` (id lists), with the
    `Translator`'s default length margin, differ from one another, and how many reach their
    limit."""
    from kyu_transformer.decoding.translator import Translator

    translations = Translator(model, beam_size=1).translate_ids(sources)
    return len({tuple(output) for output in translations.outputs}), translations.truncated_outputs


def check_varied_outputs(model, sources):
    """Raises AssertionError, naming the figure, unless the outputs vary and run long.

    What the tests rely on, checked once: the greedy outputs of `sources` (id
    lists) are mostly distinct, and both ending with EOS and reaching the limit
    are common.
    """
    distinct, cut = varied_figures(model, sources)
    figures = (f"{distinct} distinct outputs, {cut} at their limit, of {len(sources)} "
               "sources")
    assert distinct >= 0.8 * len(sources), f"the set weights give too few outputs: {figures}"
    assert 0.2 * len(sources) <= cut <= 0.8 * len(sources), \
        f"the set weights end too many or too few outputs: {figures}"


def clear_greedy_choices(model, source_ids, greedy, margin):
    """Indices of the decoded sources whose greedy choices each lead the runner-up logit by
    `margin` (where sampling near temperature 0 must choose as greedy search does).

    Args:
      model: The `Transformer`.
      source_ids: Lists of source ids (without EOS).
      greedy: The `Translations` of greedy search of them.
    """
    import numpy as np

    from kyu_transformer.conventions import BOS_ID, EOS_ID
    from kyu_transformer.decoding.scoring import padded_ids as padded

    decoded = [i for i, ids in enumerate(source_ids) if ids]
    clear = []
    for first in range(0, len(decoded), 64):
        rows = decoded[first:first + 64]
        targets = [greedy.hypotheses[i][0] + ([EOS_ID] if greedy.ended[i][0] else [])
                   for i in rows]
        logits = np.asarray(model({
            "source": padded([(list(source_ids[i]) + [EOS_ID])[:model.maxlen1] for i in rows]),
            "target_in": padded([[BOS_ID] + target[:-1] for target in targets])}), "float64")
        top = np.sort(logits, axis=-1)
        gaps = top[..., -1] - top[..., -2]  # (N, T)
        clear += [i for i, row, target in zip(rows, gaps, targets)
                  if row[:len(target)].min() >= margin]
    return clear


if __name__ == "__main__":  # python -m tests.varied_model SEED ...: each seed's figures on val
    import pathlib
    import sys
    import tempfile

    from tests.conftest import TINY_ARCHITECTURE, load_logdir
    from tests.test_data import MULTI30K

    val_sources, _, _ = load_split(MULTI30K, "val")
    with tempfile.TemporaryDirectory() as folder:
        for seed in map(int, sys.argv[1:]):
            logdir = write_varied_logdir(pathlib.Path(folder, str(seed)), MULTI30K,
                                         TINY_ARCHITECTURE, seed)
            _, model, subwords = load_logdir(pathlib.Path(logdir))
            distinct, cut = varied_figures(model, subwords.encode(val_sources))
            print(f"seed {seed}: {distinct} distinct greedy outputs, {cut} at their limit, "
                  f"of {len(val_sources)}", flush=True)
