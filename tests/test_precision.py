"""`mixed_precision auto`: the choice for the machine at hand, and what it rests on."""

import json

import pytest

import hparams as hp
from kyu_transformer.precision import (
    BFLOAT16_MARGIN, MIN_PROBE_FLOPS, choose_precision, probe_flops, resolve_precision,
    scales_the_loss, time_matmuls)
from tests import gpus
from tests.programs import run
from tests.test_training import run_train

SMALL = hp.parse("small")


def test_on_a_cpu_bfloat16_needs_its_margin():
    fast = {"float32": 0.030, "bfloat16": 0.030 / BFLOAT16_MARGIN}
    assert choose_precision(SMALL, gpus=[], timings=fast)[0] == "bf16"
    just_under = {"float32": 0.030, "bfloat16": 0.030 / (BFLOAT16_MARGIN - 0.01)}
    value, reason = choose_precision(SMALL, gpus=[], timings=just_under)
    assert value == "no"
    assert reason == ("CPU matrix products of the model's shapes: float32 30.0 ms, bfloat16 "
                      "25.2 ms (1.19x; bfloat16 needs 1.2x)")
    slow = {"float32": 0.030, "bfloat16": 0.060}  # emulated bfloat16: half the speed
    assert choose_precision(SMALL, gpus=[], timings=slow)[0] == "no"


def test_a_model_too_small_to_gain_stays_in_float32_without_timing():
    tiny = hp.parse("tiny")
    assert probe_flops(tiny) < MIN_PROBE_FLOPS <= probe_flops(SMALL)
    fast = {"float32": 1.0, "bfloat16": 0.1}  # would choose bfloat16 if it were timed
    value, reason = choose_precision(tiny, gpus=[], timings=fast)
    assert value == "no" and "too small for a half-precision type to pay (34 MFLOP" in reason
    assert choose_precision(tiny, gpus=[(7, 5)])[0] == "no"  # on a GPU too


def test_on_a_gpu_bfloat16_where_native_else_float16():
    assert choose_precision(SMALL, gpus=[(8, 0)])[0] == "bf16"
    assert choose_precision(SMALL, gpus=[(9, 0), (8, 6)])[0] == "bf16"
    value, reason = choose_precision(SMALL, gpus=[(7, 5)])
    assert value == "fp16" and "compute capability 7.5" in reason
    assert choose_precision(SMALL, gpus=[(8, 0), (7, 0)])[0] == "fp16"  # the weakest decides
    assert choose_precision(SMALL, gpus=[(7, 0)])[0] == "fp16"


def test_on_a_gpu_without_tensor_cores_float32():
    value, reason = choose_precision(SMALL, gpus=[(6, 1)])
    assert (value, reason) == ("no", "GPU of compute capability 6.1: no tensor cores (from 7.0), "
                               "float16 would gain no speed over float32")
    assert choose_precision(SMALL, gpus=[(8, 0), (6, 0)])[0] == "no"  # the weakest decides


@pytest.mark.parametrize("gpu, chosen, scaled", [
    ({"device_name": "Tesla P40", "compute_capability": (6, 1)}, "no", False),
    (gpus.T4, "fp16", True), (gpus.A100, "bf16", False)])
def test_auto_on_the_gpu_tensorflow_lists_and_its_loss_scaling(monkeypatch, gpu, chosen, scaled):
    gpus.faker(monkeypatch)(gpu, gpu)
    lines = []
    assert resolve_precision("auto", SMALL, log=lines.append) == chosen
    major, minor = gpu["compute_capability"]
    assert lines == [f"mixed_precision auto: {chosen} ({choose_precision(SMALL)[1]})"]
    assert f"GPU of compute capability {major}.{minor}: " in lines[0]
    assert scales_the_loss("auto", SMALL) is scaled  # float16's loss-scale optimizer
    assert scales_the_loss("fp16", SMALL) and not scales_the_loss("bf16", SMALL)


def test_the_probe_times_both_dtypes_and_auto_says_its_choice():
    timings = time_matmuls(SMALL, repeats=2)
    assert set(timings) == {"float32", "bfloat16"} and all(t > 0 for t in timings.values())
    lines = []
    value = resolve_precision("auto", SMALL, log=lines.append)
    assert value in ("no", "bf16") and lines[0].startswith(f"mixed_precision auto: {value} (")
    assert resolve_precision("fp16", SMALL, log=lines.append) == "fp16" and len(lines) == 1


@pytest.mark.slow  # two train.py runs and an eval.py run
@pytest.mark.tensorflow_only("the train.py and eval.py programs")
def test_auto_keeps_a_logdirs_precision_and_eval_chooses_for_its_own_machine(tmp_path):
    logdir = tmp_path / "log"
    first = run_train(logdir, "--mixed_precision", "bf16", "--steps_per_epoch", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    # `auto` on resume matches the value the run was recorded with, whatever this machine picks
    resumed = run_train(logdir, "--mixed_precision", "auto", "--steps_per_epoch", "3",
                        "--num_epochs", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "mixed_precision auto" not in resumed.stdout
    assert json.loads((logdir / "hparams.json").read_text())["mixed_precision"] == "bf16"
    # eval.py decides for the machine it runs on (this tiny model: float32, by rule)
    evaluated = run("eval.py", "--logdir", logdir, "--split", "val", "--beam_size", 1)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((logdir / "eval" / "val.json").read_text())
    assert result["mixed_precision"] == "no"
    assert result["precision_choice"].startswith("mixed_precision auto: no (the model's matrix "
                                                 "products are too small")
    assert result["precision_choice"] in evaluated.stderr  # stdout may hold translations
