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
