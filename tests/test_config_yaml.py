"""Reading recipes: duplicate keys are refused (with both lines), text must be UTF-8, and the strict loader
reads everything else exactly as yaml.safe_load does."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from memrl.config import ConfigError, load_config, load_yaml

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(("text", "words"), [
    ("train:\n  lr: 1.0e-3\ntrain:\n  seed: 3\n", "duplicate key 'train' on lines 1 and 3"),  # a second block
    ("train:\n  lr: 1.0e-3\n  seed: 2\n  lr: 2.0e-3\n", "duplicate key 'lr' on lines 2 and 4"),  # inside a section
    ("train: {lr: 1.0e-3, lr: 2.0e-3}\n", "duplicate key 'lr' on line 1"),
])
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        load_config(write(tmp_path, text))


def test_an_override_value_with_a_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(None, ["train={lr: 1.0e-3, lr: 2.0e-3}"])


def test_merge_keys_may_still_be_overridden():
    # `<<: *base` then a key of its own is YAML's way to override a merged value, not a duplicate.
    assert load_yaml("base: &b {lr: 1, seed: 2}\ntrain:\n  <<: *b\n  seed: 5\n")["train"] == {"lr": 1, "seed": 5}


@pytest.mark.parametrize("text", ["{[1]: 2}\n", "a: [1\n"])
def test_other_bad_yaml_is_still_a_yaml_error(text):
    with pytest.raises(yaml.YAMLError):
        load_yaml(text)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_read_as_safe_load_reads_them(recipe):
    text = recipe.read_text(encoding="utf-8")
    assert load_yaml(text) == yaml.safe_load(text)


def test_a_recipe_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    data = "train:\n  lr: 1.0e-3  # café\n".encode("latin-1")
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=rf"is not UTF-8 text \(byte {data.index(0xE9)}: invalid continuation byte\)"):
        load_config(path)


def test_a_utf8_recipe_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbftrain:\n  lr: 0.5\n")
    assert load_config(path).train.lr == 0.5


def test_a_folder_given_as_recipe_is_not_called_missing(tmp_path):
    with pytest.raises(ConfigError, match=f"recipe '{tmp_path}' is not a file"):
        load_config(tmp_path)


@pytest.mark.parametrize(("seed", "ok"), [(0, True), (2**63 - 1, True), (2**63, False), (2**64, False), (-1, False)])
def test_train_seed_fits_the_trainer_rng(seed, ok):
    # torch.manual_seed takes 64 bits: 2**64 was an overflow traceback at the first step.
    if ok:
        assert load_config(None, [f"train.seed={seed}"]).train.seed == seed
    else:
        with pytest.raises(ConfigError, match=f"train.seed = {seed}"):
            load_config(None, [f"train.seed={seed}"])


def test_unquoted_on_and_off_read_as_the_words_they_are_written_as(tmp_path):
    # YAML 1.1 reads unquoted on/off as true/false; the documented values of these fields are the words.
    cfg = load_config(write(tmp_path, "engine:\n  static_kv: on\n  cuda_graphs: off\n"))
    assert (cfg.engine.static_kv, cfg.engine.cuda_graphs) == ("on", "off")
    cfg = load_config(write(tmp_path, "engine:\n  static_kv: off\n  cuda_graphs: on\n"), ["engine.static_kv=on"])
    assert (cfg.engine.static_kv, cfg.engine.cuda_graphs) == ("on", "on")
    with pytest.raises(ConfigError, match="engine.kind"):  # a bool is still no word of a field without on/off
        load_config(write(tmp_path, "engine:\n  kind: on\n"))
