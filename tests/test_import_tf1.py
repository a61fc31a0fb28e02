"""import_tf1.py: a checkpoint of Kyubyong Park's TensorFlow 1.12 Transformer (2019) made here in
a `tf.compat.v1` graph, imported, scores as that graph does; the refusals.

The graph is written for this test from that code's arithmetic (its variable scopes, dense
layers as matmul and bias, sinusoids zero where the scaled embedding is, post-norm with epsilon
1e-8, logits against the shared table), small and with random weights, in two versions: the
final one (attention biases, padding keys masked by id) and that of March 2019 (no attention
biases, keys and queries masked where their projected vectors are all zero).
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import import_tf1
from kyu_transformer import config, filenames
from kyu_transformer.conventions import BOS_ID, EOS_ID
from kyu_transformer.data.subwords import Subwords
from kyu_transformer.data.text import load_split
from kyu_transformer.export.ctranslate2 import unsupported_settings
from kyu_transformer.training.checkpoints import load_model
from tests.programs import run
from tests.test_data import MULTI30K

v1 = tf.compat.v1
SIZES = dict(d_model=16, d_ff=32, num_blocks=2, num_heads=2, maxlen1=40, maxlen2=40)
PADDING_SCORE = -2.0**32 + 1  # that code's score of a hidden key


class TF1Graph:
    """The 2019 code's forward pass for one sentence pair, its variables named as its calls
    name them, and Adam's (minimize made, never run), saved by a `Saver` as that code does."""

    def __init__(self, hparams, biases, seed=0):
        self.hparams, self.biases = hparams, biases
        self.rng = np.random.default_rng(seed)
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.source = v1.placeholder(tf.int32, (1, None))  # pieces + EOS
            self.target_in = v1.placeholder(tf.int32, (1, None))  # BOS + pieces
            self.labels = v1.placeholder(tf.int32, (1, None))  # pieces + EOS
            self.log_prob = self._log_prob()
            step = v1.train.get_or_create_global_step()
            v1.train.AdamOptimizer(1e-4).minimize(-self.log_prob, global_step=step)
            self.session = v1.Session(graph=self.graph)
            self.session.run(v1.global_variables_initializer())
            self.session.run(step.assign(1234))
            self.saver = v1.train.Saver()

    def _variable(self, name, shape, scale, center=0.0):
        value = center + scale * self.rng.standard_normal(shape)
        return v1.get_variable(name, initializer=tf.constant(value, tf.float32))

    def _dense(self, x, units, name, bias=True, activation=None):
        with v1.variable_scope(name):
            width = x.shape[-1]
            y = tf.einsum("ntc,cu->ntu", x, self._variable("kernel", (width, units),
                                                           width ** -0.5))
            if bias:
                y += self._variable("bias", (units,), 0.1)
        return activation(y) if activation else y

    def _norm(self, x):
        with v1.variable_scope("ln"):
            mean, variance = tf.nn.moments(x, [-1], keepdims=True)
            beta = self._variable("beta", (x.shape[-1],), 0.1)
            gamma = self._variable("gamma", (x.shape[-1],), 0.1, center=1.0)
            return gamma * (x - mean) / (variance + 1e-8) ** 0.5 + beta

    def _attention(self, queries, keys, key_ids, scope, causal=False):
        heads, width = self.hparams["num_heads"], self.hparams["d_model"]
        with v1.variable_scope(scope):
            q, k, v = (self._dense(x, width, name, self.biases) for x, name in (
                (queries, "dense"), (keys, "dense_1"), (keys, "dense_2")))
            q, k, v = (tf.concat(tf.split(x, heads, axis=2), axis=0) for x in (q, k, v))
            scores = tf.matmul(q, k, transpose_b=True) / (width // heads) ** 0.5  # (hN, Tq, Tk)
            if self.biases:  # the final version: padding keys by id
                keep = tf.tile(tf.not_equal(key_ids, 0), [heads, 1])[:, None, :]
            else:  # before: keys whose projection is all zero
                keep = tf.not_equal(tf.reduce_sum(tf.abs(k), -1), 0)[:, None, :]
            keep = tf.broadcast_to(keep, tf.shape(scores))
            if causal:
                keep &= tf.cast(tf.linalg.band_part(tf.ones_like(scores), -1, 0), tf.bool)
            weights = tf.nn.softmax(tf.where(keep, scores, PADDING_SCORE * tf.ones_like(scores)))
            if not self.biases:  # and queries likewise, after the softmax
                weights *= tf.sign(tf.reduce_sum(tf.abs(q), -1))[:, :, None]
            outputs = tf.concat(tf.split(tf.matmul(weights, v), heads, axis=0), axis=2)
            return self._norm(outputs + queries)

    def _feed_forward(self, x):
        with v1.variable_scope("positionwise_feedforward"):
            inner = self._dense(x, self.hparams["d_ff"], "dense", activation=tf.nn.relu)
            return self._norm(self._dense(inner, self.hparams["d_model"], "dense_1") + x)

    def _embed(self, table, ids, maxlen):
        width = self.hparams["d_model"]
        x = tf.nn.embedding_lookup(table, ids) * width ** 0.5  # (1, T, C)
        angles = np.array([[position / 10000 ** ((i - i % 2) / width) for i in range(width)]
                           for position in range(maxlen)])
        angles[:, 0::2], angles[:, 1::2] = np.sin(angles[:, 0::2]), np.cos(angles[:, 1::2])
        encodings = tf.constant(angles, tf.float32)[None, :tf.shape(ids)[1]]
        return x + tf.where(tf.equal(x, 0), x, tf.broadcast_to(encodings, tf.shape(x)))

    def _log_prob(self):
        with v1.variable_scope("shared_weight_matrix"):
            table = self._variable("weight_mat", (self.hparams["vocab_size"],
                                                  self.hparams["d_model"]), 0.1)
            table = tf.concat([tf.zeros_like(table[:1]), table[1:]], 0)
        with v1.variable_scope("encoder"):
            memory = self._embed(table, self.source, self.hparams["maxlen1"])
            for index in range(self.hparams["num_blocks"]):
                with v1.variable_scope(f"num_blocks_{index}"):
                    memory = self._attention(memory, memory, self.source, "multihead_attention")
                    memory = self._feed_forward(memory)
        with v1.variable_scope("decoder"):
            x = self._embed(table, self.target_in, self.hparams["maxlen2"])
            for index in range(self.hparams["num_blocks"]):
                with v1.variable_scope(f"num_blocks_{index}"):
                    x = self._attention(x, x, self.target_in, "self_attention", causal=True)
                    x = self._attention(x, memory, self.source, "vanilla_attention")
                    x = self._feed_forward(x)
        log_softmax = tf.nn.log_softmax(tf.einsum("ntc,vc->ntv", x, table))
        return tf.reduce_sum(tf.gather(log_softmax[0], self.labels[0], batch_dims=1))

    def score(self, source_ids, target_ids):
        """The log-probability of one pair (id lists without markers), run alone."""
        return float(self.session.run(self.log_prob, {
            self.source: [source_ids + [EOS_ID]], self.target_in: [[BOS_ID] + target_ids],
            self.labels: [target_ids + [EOS_ID]]}))

    def save(self, folder, vocab):
        """A checkpoint in `folder` (prefix model_E01-1234) and the code's `hparams` file."""
        os.makedirs(folder, exist_ok=True)
        flags = {**self.hparams, "vocab": vocab, "dropout_rate": 0.3, "smoothing": 0.1,
                 "lr": 0.0003, "batch_size": 128, "logdir": str(folder)}
        with open(os.path.join(folder, "hparams"), "w", encoding="utf-8") as handle:
            json.dump(flags, handle)
        with self.graph.as_default():
            return self.saver.save(self.session, os.path.join(folder, "model_E01"),
                                   global_step=v1.train.get_global_step())


def train_bpe(folder):
    """That code's subword model, `folder`/bpe.model and bpe.vocab, on Multi30k's first lines."""
    import sentencepiece

    sources, targets, _ = load_split(MULTI30K, "train")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sources[:1500] + targets[:1500]),
        model_prefix=os.path.join(folder, "bpe"), vocab_size=300, model_type="bpe",
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False, minloglevel=2)
    return Subwords(os.path.join(folder, "bpe.model"))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The subword model and, per version (with and without biases), a graph and its checkpoint."""
    root = tmp_path_factory.mktemp("tf1")
    os.makedirs(root / "segmented")
    subwords = train_bpe(str(root / "segmented"))
    hparams = {**SIZES, "vocab_size": subwords.vocab_size}
    graphs = {}
    for biases in (True, False):
        graph = TF1Graph(hparams, biases, seed=int(biases))
        folder = root / f"log-{'biases' if biases else 'no-biases'}"
        prefix = graph.save(str(folder), str(root / "segmented" / "bpe.vocab"))
        graphs[biases] = {"graph": graph, "folder": folder, "prefix": prefix}
    return {"root": root, "subwords": subwords, "hparams": hparams, "graphs": graphs}


def pairs(subwords, count=7):
    """Val pairs of many lengths, short enough for maxlen (mixed in eval.py's batches)."""
    sources, targets, _ = load_split(MULTI30K, "val")
    chosen = [(s, t) for s, t in zip(sources, targets)
              if len(subwords.encode([s])[0]) < 30 and len(subwords.encode([t])[0]) < 30]
    chosen.sort(key=lambda pair: len(pair[0]))
    picked = np.linspace(0, len(chosen) - 1, count).round().astype(int)
    return [chosen[i] for i in picked] + [("Ein Hund.", "A dog.")]


@pytest.mark.slow
@pytest.mark.parametrize("biases", [True, False], ids=["biases", "no_biases"])
def test_the_imported_model_scores_as_the_tf1_graph(made, biases, tmp_path):
    made_graph = made["graphs"][biases]
    logdir = tmp_path / "imported"
    # The folder with its `checkpoint` file, and no --subword_model: the `vocab`'s .model.
    result = run("import_tf1.py", "--checkpoint", made_graph["folder"], "--logdir", logdir,
                 "--hparams", "data_dir=" + MULTI30K)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"attention projections {'with' if biases else 'without'} biases" in result.stdout
    assert ("masks it by id" in result.stdout) == (not biases)
    assert sorted(os.listdir(logdir)) == sorted([filenames.HPARAMS, filenames.SUBWORDS,
                                                 filenames.SUBWORDS_VOCABULARY,
                                                 filenames.CHECKPOINTS])
    hparams = config.load(str(logdir / filenames.HPARAMS))
    assert {key: hparams[key] for key in made["hparams"]} == made["hparams"]
    assert (hparams["epsilon"], hparams["dropout_rate"], hparams["smoothing"]) == (1e-8, 0.3, 0.1)
    model, paths = load_model(hparams, str(logdir))
    assert os.path.basename(paths[0]) == "ckpt-1234"  # the code's global step
    assert unsupported_settings(model, hparams) == []

    subwords, chosen = made["subwords"], pairs(made["subwords"])
    (tmp_path / "given.de").write_text("".join(s + "\n" for s, _ in chosen), encoding="utf-8")
    (tmp_path / "given.en").write_text("".join(t + "\n" for _, t in chosen), encoding="utf-8")
    result = run("eval.py", "--logdir", logdir, "--src", tmp_path / "given.de", "--score",
                 tmp_path / "given.en", "--batch_size", 3, "--mixed_precision", "no")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in
            (logdir / "eval" / "given.scores.jsonl").read_text(encoding="utf-8").splitlines()]
    expected = [made_graph["graph"].score(*subwords.encode([source, target]))
                for source, target in chosen]
    np.testing.assert_allclose([row["log_prob"] for row in rows], expected, atol=1e-4, rtol=0)


def _import(argv):
    """import_tf1.main's one-line refusal."""
    with pytest.raises(SystemExit) as stopped:
        import_tf1.main([str(word) for word in argv])
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def _resaved(made, tmp_path, change):
    """A copy of the checkpoint with biases whose variables `change` edits (a dict in place)."""
    reader = tf.train.load_checkpoint(made["graphs"][True]["prefix"])
    arrays = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    change(arrays)
    folder = tmp_path / "changed"
    with tf.Graph().as_default():
        variables = {name: v1.Variable(value) for name, value in arrays.items()}
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            v1.train.Saver(variables).save(session, str(folder / "model"))
    with open(made["graphs"][True]["folder"] / "hparams", encoding="utf-8") as handle:
        (folder / "hparams").write_text(handle.read(), encoding="utf-8")
    return folder


LAYER = "encoder/num_blocks_1/multihead_attention"


def _replace(name, value):
    return lambda arrays: arrays.update({name: value(arrays[name])})


@pytest.mark.parametrize("change, message", [
    (lambda arrays: arrays.pop(f"{LAYER}/dense_1/bias"),
     f"no variable `{LAYER}/dense_1/bias`, which the model of vocab_size="),
    (_replace("shared_weight_matrix/weight_mat", lambda table: table[:-5]),
     "variable `shared_weight_matrix/weight_mat` has shape ("),
    (_replace("decoder/num_blocks_0/positionwise_feedforward/dense/kernel", lambda k: k.T),
     "variable `decoder/num_blocks_0/positionwise_feedforward/dense/kernel` has shape (32, 16)"),
    (lambda arrays: arrays.update({f"{LAYER}/dense_3/kernel": np.zeros((16, 16), "float32")}),
     f"variable `{LAYER}/dense_3/kernel` is not in the model of"),
    (lambda arrays: arrays.update({name.replace("num_blocks_1", "num_blocks_2"): value
                                   for name, value in list(arrays.items())}),
     "variable `decoder/num_blocks_2/positionwise_feedforward/dense/bias` (and "),
    (lambda arrays: arrays.update({f"transformer/{name}": arrays.pop(name)
                                   for name in list(arrays)}),
     "not a checkpoint of the TensorFlow 1 Transformer (no `shared_weight_matrix/weight_mat`"),
], ids=["missing", "table_rows", "transposed", "unread", "more_blocks", "another_layout"])
def test_a_checkpoint_that_does_not_fit_is_refused_and_nothing_written(made, tmp_path, change,
                                                                       message):
    folder = _resaved(made, tmp_path, change)
    logdir = tmp_path / "imported"
    assert message in _import(["--checkpoint", folder / "model", "--logdir", logdir])
    assert not logdir.exists() and sorted(os.listdir(tmp_path)) == ["changed"]


@pytest.mark.parametrize("argv, message", [
    (["--hparams", "vocab_size=301"], "pieces but `vocab_size` is 301"),
    (["--hparams", "norm_position=pre"], "`norm_position` must stay 'post'"),
    (["--hparams", "epsilon=1e-6"], "`epsilon` must stay 1e-08"),
    (["--subword_model", "nowhere.model"], "--subword_model nowhere.model: no such file"),
    (["--subword_model", "{hparams}"], "not a SentencePiece model"),
    (["--checkpoint", "{folder}/model_E01"], "no such checkpoint (no {folder}/model_E01.index)"),
    (["--logdir", "{folder}"], "already exists and is not empty: import into a new logdir"),
], ids=["vocab_size", "norm_position", "epsilon", "no_subword_model", "not_subword_model",
        "no_checkpoint", "logdir_not_empty"])
def test_bad_inputs_are_refused_before_tensorflow_and_nothing_written(made, tmp_path, argv,
                                                                      message):
    folder = made["graphs"][True]["folder"]
    given = {"--checkpoint": folder, "--logdir": tmp_path / "imported",
             "--subword_model": made["root"] / "segmented" / "bpe.model"}
    words = {**given, **dict(zip(argv[::2], argv[1::2]))}
    fill = dict(folder=folder, hparams=folder / "hparams")
    argv = [str(word).format(**fill) for pair in words.items() for word in pair]
    assert message.format(**fill) in _import(argv)
    assert not (tmp_path / "imported").exists()


def test_the_hparams_file_and_subword_model_are_needed(made, tmp_path):
    prefix = made["graphs"][False]["prefix"]
    folder = tmp_path / "copy"
    os.makedirs(folder)
    for name in os.listdir(os.path.dirname(prefix)):
        if name != "hparams":
            os.link(os.path.join(os.path.dirname(prefix), name), folder / name)
    prefix = folder / os.path.basename(prefix)
    logdir = tmp_path / "imported"
    assert f"{folder}/hparams: no such file" in _import(["--checkpoint", prefix, "--logdir",
                                                         logdir])
    flags = {**made["hparams"], "vocab": str(tmp_path / "elsewhere" / "bpe.vocab")}
    (folder / "hparams").write_text(json.dumps(flags), encoding="utf-8")
    assert f"{tmp_path}/elsewhere/bpe.model (beside the `vocab`" in _import(
        ["--checkpoint", prefix, "--logdir", logdir])
    assert not logdir.exists()


@pytest.mark.slow
def test_train_refuses_to_resume_an_imported_logdir(made, tmp_path):
    logdir = tmp_path / "imported"
    result = run("import_tf1.py", "--checkpoint", made["graphs"][True]["prefix"], "--logdir",
                 logdir, "--hparams", f"data_dir={MULTI30K}")
    assert result.returncode == 0, result.stdout + result.stderr
    result = run("train.py", "--hparams", logdir / filenames.HPARAMS, "--logdir", logdir)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"--init_from {logdir}" in last, result.stderr
