import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow unless the caller chose another backend: `KERAS_BACKEND=jax python
# -m pytest -q tests` runs every test that does not need TensorFlow itself on
# JAX (the others skip, see TENSORFLOW_ONLY_MODULES and `tensorflow_only`).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# cuBLAS and cuDNN read this in every process that loads them, the programs the tests start
# included: float32 products keep float32's mantissa instead of TensorFloat-32's 10 bits, so
# that float32 tolerances hold on a GPU. Nothing reads it on a machine without an NVIDIA GPU.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
# XLA (JAX's every op, TensorFlow's `jit_compile` and XLA loss) compiles the suite's tiny
# models in less processor time, in this process and the programs it starts: without LLVM's
# optimization passes, and each fusion by XLA's elemental emitters instead of the MLIR
# pipeline the CPU backend runs for every fusion apart (a training step has about a thousand).
# The same computation in code that runs slower, which the suite's tiny kernels did not repay
# on the CPUs measured (docs/testing.md). Name a flag in XLA_FLAGS to test with its other value.
# XLA ends a process on a flag it does not know: the emitters' flag only with the releases of
# TensorFlow and jaxlib it was measured with (2.21.0, 0.10.2) and their patch releases, none of
# the next one's pre-releases (a later release may have dropped it: measure, then widen).
EMITTERS_FLAG_RELEASES = {"tensorflow": ("2.21", "2.22.dev0"), "jaxlib": ("0.10.2", "0.11.dev0")}


def fast_compiling_xla_flags(xla_flags, installed):
    """Returns `xla_flags` (XLA_FLAGS, or None) with the fast-compiling flags it does not name;
    `installed(name)`: the version of that distribution, or None."""
    flags = {"--xla_backend_optimization_level": "0"}
    if installed("tensorflow") and all(_within(installed(name), *releases) for name, releases
                                       in EMITTERS_FLAG_RELEASES.items()):
        flags["--xla_cpu_use_fusion_emitters"] = "false"
    return " ".join(filter(None, [xla_flags] + [
        f"{flag}={value}" for flag, value in flags.items() if flag not in (xla_flags or "")]))


def _within(version, first, end):
    """Whether `version` (None: not installed) is from `first` up to, not including, `end`."""
    from packaging.version import InvalidVersion, Version

    try:
        return version is None or Version(first) <= Version(version) < Version(end)
    except InvalidVersion:
        return False


def installed_version(name):
    """The installed version of distribution `name`, or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


os.environ["XLA_FLAGS"] = fast_compiling_xla_flags(os.environ.get("XLA_FLAGS"),
                                                   installed_version)
# pytest-xdist's workers share the machine's cores: each worker, and every program it starts,
# splits a TensorFlow op over its share of them only. Split over more threads than there are
# free cores, an op's threads wait for cores the other worker's ops hold (TensorFlow's pool
# spins while it waits): more processor time for the same result, on a suite that is bound by
# processor time. Set TF_NUM_INTRAOP_THREADS to choose another count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # Linux
              else os.cpu_count() or 1)
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, _CORES // _WORKERS)))
from kyu_transformer.cli.startup import import_frozen  # noqa: E402

import_frozen(("keras",))  # as the programs import it (the collector held back)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


def float32_products_in_float32():
    """Turns TensorFloat-32 off in this process's backend, as `NVIDIA_TF32_OVERRIDE` does in
    the libraries (XLA's own kernels read the backend's setting): on a GPU, products of float32
    tensors then round as float32's do, which the tests' tolerances assume. A CPU computes them
    in float32 either way."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)
    elif BACKEND == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")


float32_products_in_float32()

# Modules built on TensorFlow itself (tf.data, tf.distribute, tf.train
# checkpoints, the training and decoding programs): under another backend they
# are skipped whole, without being imported.
TENSORFLOW_ONLY_MODULES = {
    "test_benchmarks.py": "the benchmark programs, TensorFlow's",
    "test_ctranslate2.py": "the CTranslate2 export, checked against TensorFlow decoding",
    "test_data.py": "the tf.data pipeline",
    "test_decoding.py": "decoding and the eval.py program on TensorFlow checkpoints",
    "test_export.py": "the export.py program and TensorFlow SavedModels",
    "test_eval.py": "the eval.py program (n-best, scoring, CTranslate2) on TensorFlow checkpoints",
    "test_faults.py": "the training and eval.py programs",
    "test_fine_tuning.py": "train.py --init_from, on TensorFlow checkpoints",
    "test_formats.py": "a logdir's TensorFlow checkpoints, and the programs on it",
    "test_import_tf1.py": "TensorFlow 1 checkpoints, made in a tf.compat.v1 graph",
    "test_multi_worker.py": "tf.distribute multi-worker training",
    "test_optimizer.py": "the fused TensorFlow Adam kernel, tf.function and tf.distribute",
    "test_prefixes.py": "target prefixes in the searches, which run on TensorFlow",
    "test_training.py": "the tf.distribute training loop",
    "test_updates.py": "the training step under tf.distribute",
}


class _TensorFlowOnlyModule(pytest.File):
    """Stands for a TensorFlow-only test module under another backend: skips it whole."""

    def collect(self):
        pytest.skip(f"{self.path.name} needs TensorFlow "
                    f"({TENSORFLOW_ONLY_MODULES[self.path.name]}); KERAS_BACKEND is {BACKEND}")


def pytest_pycollect_makemodule(module_path, parent):
    if BACKEND != "tensorflow" and module_path.name in TENSORFLOW_ONLY_MODULES:
        return _TensorFlowOnlyModule.from_parent(parent, path=module_path)
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tensorflow_only(reason): the test needs TensorFlow itself; skipped on "
        "other backends with that reason")


# Set to 1, it runs the tests marked `cpu_exact` on a GPU too (docs/testing.md).
EXACT_ON_GPU = "KYU_EXACT_ON_GPU"


@functools.lru_cache(maxsize=None)
def gpus():
    """The names of the GPUs the Keras backend computes on, asked once a process (none on a
    machine without one, or on another backend than TensorFlow and JAX)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tuple(device.name for device in tf.config.list_physical_devices("GPU"))
    if BACKEND == "jax":
        import jax

        return tuple(str(device) for device in jax.devices() if device.platform != "cpu")
    return ()


def pytest_runtest_setup(item):
    """Skips a test marked `cpu_exact` where the backend sees a GPU, unless KYU_EXACT_ON_GPU=1:
    it compares exactly, or to a CPU's rounding, what two kernels compute (for other batch
    shapes, a cache and a recomputation, another engine or device); a GPU's kernels round
    otherwise and may tip a near-tie. (Asked as the test starts, its output captured.)"""
    if (item.get_closest_marker("cpu_exact") is not None
            and os.environ.get(EXACT_ON_GPU) != "1" and gpus()):
        pytest.skip(f"cpu_exact: assumes a CPU's rounding, and the backend sees "
                    f"{', '.join(gpus())}; {EXACT_ON_GPU}=1 runs it")


@pytest.fixture(autouse=True)
def _op_determinism(request):
    """Runs a test marked `op_determinism` with TensorFlow's deterministic ops (as train.py
    --deterministic): on a GPU, sums of scattered rows otherwise add in any order."""
    if request.node.get_closest_marker("op_determinism") is None or BACKEND != "tensorflow":
        yield
        return
    # tf.config has no public switch back; the next tests run as they would have.
    from tensorflow.python.framework import config as tf_config

    enabled = tf_config.is_op_determinism_enabled()
    tf_config.enable_op_determinism()
    try:
        yield
    finally:
        if not enabled:
            tf_config.disable_op_determinism()


# Fixtures of logdirs (trained by train.py, or written with set weights): the tests
# that use them decode hundreds of sentences or start the programs, and are slow.
SLOW_FIXTURES = {"trained", "trained_logdir", "trained_tiny_logdir", "varied",
                 "varied_tiny_logdir"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    if BACKEND == "tensorflow":
        return
    for item in items:
        marker = item.get_closest_marker("tensorflow_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(
                reason=f"needs TensorFlow itself ({reason}); KERAS_BACKEND is {BACKEND}"))


# The trained model's last logged loss is below this fraction of a uniform guess's.
LEARNED_LOSS_RATIO = 0.7
# The size of both session logdirs' models, beside the `tiny` preset's other settings.
TINY_ARCHITECTURE = {"d_model": 64, "d_ff": 128, "num_heads": 4}


@pytest.fixture(scope="session")
def trained_tiny_logdir(tmp_path_factory):
    """A logdir of a small model trained by train.py for 3 epochs (300 steps), with validation BLEU.

    Trained once for the whole run, whichever pytest-xdist worker needs it first (the
    others wait for it: several modules decode with it); a module copies it
    (`copy_of_logdir`) before writing into it.
    """
    import fcntl

    # Under pytest-xdist each worker has its own base temp; their parent is the run's.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    logdir = root / "trained-tiny" / "log"
    with open(root / "trained-tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (logdir / "train_output.txt").exists():  # written last, once it has learned
            _train_tiny_logdir(logdir)
    return logdir


def _train_tiny_logdir(logdir):
    import json
    import math
    import shutil

    from tests import programs
    from tests.test_data import MULTI30K

    shutil.rmtree(logdir, ignore_errors=True)  # what a failed attempt left
    result = programs.run(
        "train.py", "--hparams", "tiny", "--data_dir", MULTI30K, "--logdir", logdir,
        "--lr", "1.0", "--num_epochs", "3", "--steps_per_epoch", "100", "--eval_sentences", "50",
        *[word for key, value in TINY_ARCHITECTURE.items() for word in (f"--{key}", value)],
        timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    # What the tests of a trained model rely on, on any processor: it learned.
    losses = [row["loss"] for row in map(json.loads, (logdir / "history.jsonl").read_text()
                                         .splitlines()) if row.get("kind") == "train"]
    uniform = math.log(json.loads((logdir / "hparams.json").read_text())["vocab_size"])
    assert losses[-1] < LEARNED_LOSS_RATIO * uniform, (
        f"the trained model did not learn: its last logged loss is {losses[-1]:.3f}, not "
        f"below {LEARNED_LOSS_RATIO} of a uniform guess's ({uniform:.3f})")
    (logdir / "train_output.txt").write_text(result.stdout)


@pytest.fixture(scope="session")
def varied_tiny_logdir(tmp_path_factory):
    """A logdir of the trained model's architecture whose weights are set, not trained.

    Its outputs vary and often reach their limit on every processor (see
    `tests/varied_model.py`, which checks it once here), for the tests of the
    search, the exports and the engines. Made once for the session; a module
    copies it (`copy_of_logdir`) before writing into it.
    """
    import pathlib

    from kyu_transformer.data.text import load_split
    from tests.test_data import MULTI30K
    from tests.varied_model import check_varied_outputs, write_varied_logdir

    logdir = pathlib.Path(write_varied_logdir(tmp_path_factory.mktemp("varied-tiny") / "log",
                                              MULTI30K, TINY_ARCHITECTURE))
    _, model, subwords = load_logdir(logdir)
    val, _, _ = load_split(MULTI30K, "val")
    check_varied_outputs(model, subwords.encode(val))
    return logdir


def load_logdir(logdir):
    """``(hparams, model, subwords)`` of a logdir, as eval.py loads them."""
    from kyu_transformer import config, filenames
    from kyu_transformer.data.subwords import Subwords
    from kyu_transformer.training.checkpoints import load_model

    hparams = config.load(str(logdir / "hparams.json"))
    model, _ = load_model(hparams, str(logdir))
    return hparams, model, Subwords(str(logdir / filenames.SUBWORDS))


def copy_of_logdir(logdir, tmp_path_factory, name):
    """A copy of one of the session's logdirs, for a module to write into."""
    import shutil

    copy = tmp_path_factory.mktemp(name) / "log"
    shutil.copytree(logdir, copy)
    return copy


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts with float32, a fixed seed and no leftover policy."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def value_and_gradients(loss_fn, tensors, variables=()):
    """Runs ``loss_fn(*tensors) -> (loss, aux)`` once, differentiated by the backend.

    Returns ``(aux, gradients)``: the gradients of the scalar `loss` with
    respect to each of `tensors`, then each of the Keras `variables`. `aux`
    comes from the same run, so a random draw (dropout) is the one the
    gradients went through.
    """
    tensors = [keras.ops.convert_to_tensor(tensor) for tensor in tensors]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(tensors)
            loss, aux = loss_fn(*tensors)
        return aux, tape.gradient(loss, tensors + [variable.value for variable in variables])
    if BACKEND == "jax":
        import jax

        def pure(tensors, values):
            # The variables read the traced values; assignments made inside
            # (a seed generator's state) stay in the scope instead of leaking
            # tracers into the variables.
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss_fn(*tensors)

        (_, aux), (tensor_grads, variable_grads) = jax.value_and_grad(
            pure, argnums=(0, 1), has_aux=True)(tensors, [v.value for v in variables])
        return aux, list(tensor_grads) + list(variable_grads)
    pytest.skip(f"no gradient helper for the {BACKEND} backend")


@pytest.fixture(name="value_and_gradients")
def _value_and_gradients_fixture():
    return value_and_gradients


def compiled(fn):
    """`fn` traced and compiled by the backend (tf.function, jax.jit), as `fit` and `predict` do."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return fn


@pytest.fixture(name="compiled")
def _compiled_fixture():
    return compiled
