"""TrainConfig from TOML, and the `train` command's wiring."""

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from rollstream.cli.main import app
from rollstream.trainer.config import TrainConfig


def test_top_level_toml_with_defaults_resolves_paths_against_the_file(tmp_path):
    (tmp_path / "train.toml").write_text('model_dir = "m"\ntask = "echo"\nprompts_file = "p.jsonl"\n'
                                         '[loss]\ntis_cap = 2.0\n')
    config = TrainConfig.from_toml(tmp_path / "train.toml", steps=7)
    assert config.model_dir == tmp_path / "m" and config.prompts_file == tmp_path / "p.jsonl"
    assert config.steps == 7 and config.loss.tis_cap == 2.0
    assert (config.loss.clip_low, config.loss.clip_high, config.loss.kl_coef) == (0.2, 0.28, 0.0)
    assert config.sampler.overflow_mode == "cancel"


def test_unknown_keys_are_rejected_instead_of_silently_ignored(tmp_path):
    (tmp_path / "train.toml").write_text('model_dir = "m"\ntask = "echo"\nprompts_file = "p"\n[loss]\nclip_hi = 0.3\n')
    with pytest.raises(ValidationError, match="clip_hi"):
        TrainConfig.from_toml(tmp_path / "train.toml")


def test_missing_config_file_says_where_to_look(tmp_path):
    with pytest.raises(FileNotFoundError, match="README"):
        TrainConfig.from_toml(tmp_path / "nope.toml")


def test_train_command_help_lists_its_options():
    result = CliRunner().invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    for option in ("--steps", "--output-dir", "--redis", "--json"):
        assert option in result.output
