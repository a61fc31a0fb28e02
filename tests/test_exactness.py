"""What the tests assume of exactness: where the backend sees a GPU (a faked device list here)
the tests marked `cpu_exact` skip, unless KYU_EXACT_ON_GPU=1; TensorFloat-32 is off; a test
marked `op_determinism` runs with TensorFlow's deterministic ops; XLA compiles with the
flags its release knows."""

import os

import pytest

from tests import conftest

GPU = "/physical_device:GPU:0"


@pytest.mark.cpu_exact
def exact_on_a_cpu():
    """Stands for a test marked `cpu_exact` (collected below, not by pytest)."""


def exact_anywhere():
    """Stands for a test without the mark."""


class _FakeJaxDevice:
    platform = "gpu"

    def __str__(self):
        return GPU


@pytest.fixture
def seen_gpus(monkeypatch):
    """``see(names)`` makes the backend report GPUs of those names (none: a CPU machine) and
    clears what `conftest.gpus` remembered; returns the list of the questions asked since."""
    asked = []

    def see(names):
        if conftest.BACKEND == "tensorflow":
            import tensorflow as tf

            def listed(device_type=None):
                asked.append(device_type)
                return [tf.config.PhysicalDevice(name, "GPU") for name in names]
            monkeypatch.setattr(tf.config, "list_physical_devices", listed)
        elif conftest.BACKEND == "jax":
            import jax

            monkeypatch.setattr(jax, "devices", lambda: asked.append("devices") or [
                _FakeJaxDevice() for _ in names])
        else:
            pytest.skip(f"conftest asks only TensorFlow and JAX, not {conftest.BACKEND}")
        conftest.gpus.cache_clear()
        return asked

    yield see
    monkeypatch.undo()
    conftest.gpus.cache_clear()  # the machine's own answer again, for the tests after


def items(request):
    """Items of `exact_on_a_cpu` and `exact_anywhere`, as the collection makes them."""
    return [pytest.Function.from_parent(request.node.parent, name=function.__name__,
                                        callobj=function)
            for function in (exact_on_a_cpu, exact_anywhere)]


def skip_reason(item):
    """Why conftest skips `item` as it starts, or None where it runs."""
    try:
        conftest.pytest_runtest_setup(item)
    except pytest.skip.Exception as skipped:
        return skipped.msg
    return None


def test_cpu_exact_tests_skip_where_a_gpu_is_seen_and_say_how_to_run_them(
        request, seen_gpus, monkeypatch):
    monkeypatch.delenv(conftest.EXACT_ON_GPU, raising=False)
    asked = seen_gpus([GPU])
    exact, anywhere = items(request)
    assert skip_reason(exact) == (f"cpu_exact: assumes a CPU's rounding, and the backend sees "
                                  f"{GPU}; KYU_EXACT_ON_GPU=1 runs it")
    assert skip_reason(anywhere) is None
    assert skip_reason(exact) is not None
    assert len(asked) == 1  # the backend is asked once a process


def test_cpu_exact_tests_run_on_a_gpu_when_asked_and_on_a_cpu(request, seen_gpus, monkeypatch):
    seen_gpus([GPU])
    monkeypatch.setenv(conftest.EXACT_ON_GPU, "1")
    assert [skip_reason(item) for item in items(request)] == [None, None]
    monkeypatch.delenv(conftest.EXACT_ON_GPU)
    seen_gpus([])  # a machine without a GPU
    assert [skip_reason(item) for item in items(request)] == [None, None]


def test_a_test_without_the_mark_does_not_ask_the_backend(request, seen_gpus):
    asked = seen_gpus([GPU])
    assert skip_reason(items(request)[1]) is None and asked == []


def test_the_tests_and_their_programs_compute_without_tensor_float_32():
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"  # what the programs inherit
    if conftest.BACKEND == "tensorflow":
        import tensorflow as tf

        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    elif conftest.BACKEND == "jax":
        import jax

        assert jax.config.jax_default_matmul_precision == "highest"


def test_xla_compiles_fast_with_the_flags_its_release_knows():
    """The fast-compiling flags reach the programs (XLA_FLAGS), unless XLA_FLAGS named them;
    the emitters' flag only with the TensorFlow and jaxlib (where installed) releases measured
    with it; a flag XLA_FLAGS names already is left as it is."""
    ours = conftest.fast_compiling_xla_flags(None, conftest.installed_version).split()
    assert "--xla_backend_optimization_level=0" in ours
    for flag in ours:
        assert flag.split("=")[0] in os.environ["XLA_FLAGS"]
    measured = {"tensorflow": "2.21.0", "jaxlib": "0.10.2"}
    both = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    for known in (measured, {"tensorflow": "2.21.3"}, {**measured, "jaxlib": "0.10.9"}):
        assert conftest.fast_compiling_xla_flags(None, known.get) == both, known
    for other in ({**measured, "tensorflow": "2.20.0"}, {**measured, "tensorflow": "2.22.0"},
                  {**measured, "tensorflow": "2.21.0rc1"}, {**measured, "jaxlib": "0.10.1"},
                  {**measured, "jaxlib": "0.11.0"}, {**measured, "tensorflow": "2.22.0rc0"},
                  {**measured, "jaxlib": "0.11.0.dev20260101"},
                  {**measured, "tensorflow": "2.21-custom"},
                  {"jaxlib": "0.10.2"}):  # TensorFlow under another distribution's name
        assert conftest.fast_compiling_xla_flags(None, other.get) == (
            "--xla_backend_optimization_level=0"), other
    assert conftest.fast_compiling_xla_flags(
        "--xla_dump_to=d --xla_cpu_use_fusion_emitters=true", measured.get) == (
        "--xla_dump_to=d --xla_cpu_use_fusion_emitters=true --xla_backend_optimization_level=0")


@pytest.mark.tensorflow_only("TensorFlow's op determinism")
@pytest.mark.op_determinism
def test_a_test_marked_op_determinism_runs_with_deterministic_ops():
    from tensorflow.python.framework import config

    assert config.is_op_determinism_enabled()


@pytest.mark.tensorflow_only("TensorFlow's op determinism")
def test_the_tests_after_it_run_as_before():
    """(Runs after the test above: the module's tests run in their order.)"""
    from tensorflow.python.framework import config

    assert not config.is_op_determinism_enabled()
