"""hparams.py: presets, JSON files, key=value, flags and every validation error."""

import json

import pytest

import hparams as hp
from kyu_transformer import config


def test_presets_and_overrides_in_order():
    resolved = hp.parse("small,lr=3,batch_size=64", {"warmup_steps": "200"})
    assert (resolved["d_model"], resolved["num_blocks"]) == (128, 4)
    assert resolved["lr"] == 3.0 and isinstance(resolved["lr"], float)
    assert resolved["batch_size"] == 64 and resolved["warmup_steps"] == 200
    assert hp.parse("")["d_model"] == config.DEFAULTS["d_model"]
    for preset in hp.PRESETS:
        assert hp.parse(preset)  # every preset is valid


def test_json_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"d_model": 64, "num_heads": 2, "sinusoid": False}))
    resolved = hp.parse(f"tiny,{path}")
    assert (resolved["d_model"], resolved["num_heads"], resolved["sinusoid"]) == (64, 2, False)


def test_flags_override_hparams():
    args = hp.argument_parser("x").parse_args(["--hparams", "tiny", "--batch_size", "7",
                                               "--sinusoid", "false"])
    resolved = hp.from_args(args)
    assert resolved["batch_size"] == 7 and resolved["sinusoid"] is False
    assert resolved["d_model"] == hp.PRESETS["tiny"]["d_model"]


@pytest.mark.parametrize("spec,overrides,message", [
    ("", {"lerning_rate": 1}, "unknown hyperparameter `lerning_rate`"),
    ("", {"batch_szie": 1}, "did you mean `batch_size`"),
    ("smal", None, "did you mean `small`"),
    ("", {"d_model": "wide"}, "`d_model` must be int, got 'wide'"),
    ("", {"sinusoid": "maybe"}, "`sinusoid` must be true or false"),
    ("", {"fast_paths": "maybe"}, "`fast_paths` must be true or false"),
    ("", {"fast_paths": 1}, "`fast_paths` must be bool, got 1"),
    ("", {"d_model": 100, "num_heads": 8}, "`d_model` (100) must be divisible by `num_heads` (8)"),
    ("", {"num_blocks": 0}, "`num_blocks` must be positive, got 0"),
    ("", {"vocab_size": -5}, "`vocab_size` must be positive"),
    ("", {"dropout_rate": 1.0}, "`dropout_rate` must be in [0, 1), got 1.0"),
    ("", {"smoothing": -0.1}, "`smoothing` must be in [0, 1)"),
    ("", {"lr": "nan"}, "`lr` must be positive, got nan"),
    ("", {"max_minutes": float("nan")}, "`max_minutes` must be >= 0, got nan"),
    ("", {"norm_position": "middle"}, "`norm_position` must be one of post, pre"),
    ("", {"batch_tokens": 10}, "`batch_tokens` (10) must be 0 or at least"),
    ("", {"accumulate_steps": 0}, "`accumulate_steps` must be positive, got 0"),
    ("", {"accumulate_steps": "-1"}, "`accumulate_steps` must be positive, got -1"),
    ("", {"accumulate_steps": "1.5"}, "`accumulate_steps` must be int, got '1.5'"),
    ("", {"accumulate_steps": 1.5}, "`accumulate_steps` must be int, got 1.5"),
    ("missing.json", None, "no such JSON file: missing.json"),
])
def test_validation_errors(spec, overrides, message):
    with pytest.raises(config.HParamsError) as error:
        hp.parse(spec, overrides)
    assert message in str(error.value)


def test_fast_paths_on_by_default_and_off_by_flag():
    assert hp.parse("")["fast_paths"] is True
    args = hp.argument_parser("x").parse_args(["--fast_paths", "false"])
    assert hp.from_args(args)["fast_paths"] is False


def test_hparams_written_before_the_switch_load_with_fast_paths_on(tmp_path):
    resolved = hp.parse("tiny")
    del resolved["fast_paths"]
    path = tmp_path / "hparams.json"
    config.save(resolved, str(path))
    assert config.load(str(path))["fast_paths"] is True


def test_hparams_written_before_accumulation_load_with_one_batch_an_update(tmp_path):
    resolved = hp.parse("tiny")
    del resolved["accumulate_steps"]
    path = tmp_path / "hparams.json"
    config.save(resolved, str(path))
    assert config.load(str(path))["accumulate_steps"] == 1


def test_every_problem_is_reported_at_once():
    with pytest.raises(config.HParamsError) as error:
        hp.parse("", {"num_blocks": 0, "dropout_rate": 2.0})
    assert "num_blocks" in str(error.value) and "dropout_rate" in str(error.value)


def test_broken_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "d_model": 64,\n  oops\n}')
    with pytest.raises(config.HParamsError, match=r"broken.json, line 3: not valid JSON"):
        hp.parse(str(path))


def test_save_and_load_round_trip(tmp_path):
    resolved = hp.parse("tiny,seed=7")
    path = tmp_path / "hparams.json"
    config.save(resolved, str(path))
    assert config.load(str(path)) == resolved
    with pytest.raises(config.HParamsError, match="no such file"):
        config.load(str(tmp_path / "nothing.json"))
