"""The benchmark scripts on a machine without their extra: one line that names it."""

import os
import subprocess
import sys

import pytest

from tests.test_training import ROOT

MISSING_KERAS_HUB = 'raise ModuleNotFoundError("No module named \'keras_hub\'", name="keras_hub")\n'


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_throughput.py", "decode_speed.py"])
def test_benchmark_without_its_extra_names_the_extra(tmp_path, script):
    hidden = tmp_path / "site" / "keras_hub"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(MISSING_KERAS_HUB)  # as if not installed
    environment = {**os.environ, "PYTHONPATH": str(tmp_path / "site"),
                   "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script)],
                            capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        'error: this benchmark compares with keras_hub, which is not installed: '
        'pip install -e ".[bench]" (or --skip_peer)')


def test_a_baseline_revision_trains_beside_the_current_package():
    """`train_throughput.py --baseline REV`: the package at REV, importable under another name."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: --baseline reads the package from git")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import train_throughput
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    import kyu_transformer.model

    baseline = train_throughput.package_at("HEAD")
    assert baseline.Transformer.__module__ == "kyu_transformer_at_HEAD.model"
    assert baseline.Transformer is not kyu_transformer.model.Transformer
    assert sys.modules["kyu_transformer.model"] is kyu_transformer.model  # left in place
    model = train_throughput.ours(baseline)
    assert model.name == "ours" and type(model).__module__.startswith("kyu_transformer_at_HEAD")
    with pytest.raises(SystemExit, match="--baseline no-such-revision: "):
        train_throughput.package_at("no-such-revision")
