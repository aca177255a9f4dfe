"""`memrl config`: every field listed with type, value and description; recipes validated and resolved."""

from pathlib import Path

import yaml
from typer.testing import CliRunner

from memrl.cli import app
from memrl.config import Config, config_from_dict, load_config
from memrl.config_doc import describe_config, type_name

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
runner = CliRunner()


def test_every_field_of_every_section_is_listed_with_its_description():
    cfg = Config()
    text = describe_config(cfg)
    for section_name in Config.model_fields:
        assert f"[{section_name}]" in text
        # The task section is the configured task's Settings (by default MemAgent's).
        for name, field in type(getattr(cfg, section_name)).model_fields.items():
            assert f"  {section_name}.{name}: {type_name(field.annotation)}" in text, (section_name, name)
            assert field.description and field.description in text, f"{section_name}.{name} has no description"


def test_types_constraints_and_values_are_shown():
    text = describe_config(Config())
    assert "  task.truncation: 'head' | 'tail' | 'center' | 'center_chunks' = center\n" in text
    assert "  sampling.top_p: float (> 0.0, <= 1.0) = 1.0\n" in text
    assert "  model.path: str | None = null\n" in text
    assert "  train.adam_betas: tuple[float, float] = [0.9, 0.999]\n" in text
    assert "(set;" not in text  # the defaults differ from nothing


def test_a_recipes_values_are_marked_and_secrets_hidden():
    cfg = load_config(ROOT / "recipes" / "qwen3-0.6b-hotpotqa.yaml", ["engine.api_key=s3cret"])
    text = describe_config(cfg)
    assert "  algorithm.std_ddof: 0 | 1 = 1   (set; default 0)\n" in text
    assert "  task.max_chunks: int (> 0) = 4\n" in text  # equal to the default: not marked
    assert "s3cret" not in text and "engine.api_key: str | None = <hidden>" in text


def test_cli_lists_validates_and_resolves_every_shipped_recipe():
    assert RECIPES
    for recipe in RECIPES:
        listed = runner.invoke(app, ["config", "--recipe", str(recipe)])
        assert listed.exit_code == 0, (recipe, listed.output)
        assert all(f"[{section}]" in listed.output for section in ("sampling", "engine", "task"))
        resolved = runner.invoke(app, ["config", "--recipe", str(recipe), "--yaml"])
        assert resolved.exit_code == 0
        assert config_from_dict(yaml.safe_load(resolved.output)) == load_config(recipe)


def test_cli_refuses_a_bad_recipe_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task:\n  chunk_tokns: 5\n")
    result = runner.invoke(app, ["config", "--recipe", str(bad)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "did you mean 'task.chunk_tokens'" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = runner.invoke(app, ["config", "--set", "train.lr=-1"])
    assert result.exit_code == 2 and "train.lr" in result.output
