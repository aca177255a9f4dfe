from pathlib import Path

import pytest
import yaml

from memrl.config import Config, ConfigError, import_object, load_config

ROOT = Path(__file__).resolve().parents[1]
TRAIN_RECIPE = ROOT / "recipes" / "qwen3-0.6b-hotpotqa.yaml"
EVAL_RECIPE = ROOT / "recipes" / "ruler-hqa-eval.yaml"


def test_training_recipe_has_the_seed_values():
    cfg = load_config(TRAIN_RECIPE)
    assert cfg.model.path == "Qwen/Qwen3-0.6B"
    assert cfg.model.revision == "c1899de289a04d12100db370d81485cdf75e47ca"
    r = cfg.rollout
    assert (r.chunk_tokens, r.memory_tokens, r.final_tokens, r.max_chunks) == (512, 128, 64, 4)
    assert (r.n_samples, r.temperature, r.top_p, r.seed, r.enable_thinking) == (8, 1.0, 1.0, 4242, False)
    assert cfg.algorithm.credit == "split"
    assert (cfg.train.lr, cfg.algorithm.kl_coef) == (1e-6, 0.001)


def test_eval_recipe_has_the_seed_values():
    cfg = load_config(EVAL_RECIPE)
    r = cfg.rollout
    assert (r.chunk_tokens, r.memory_tokens, r.final_tokens, r.max_chunks) == (2048, 1024, 256, 64)
    assert (r.temperature, r.top_p, r.seed, r.enable_thinking) == (1.0, 1.0, 4242, False)
    assert cfg.eval.lengths == [50, 200, 800]


def test_override_sets_nested_values_with_yaml_types():
    cfg = load_config(TRAIN_RECIPE, ["rollout.chunk_tokens=256", "algorithm.credit=share", "train.pad_to_dp=true"])
    assert cfg.rollout.chunk_tokens == 256
    assert cfg.algorithm.credit == "share"
    assert cfg.train.pad_to_dp is True


def test_negative_value_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.chunk_tokens = -5"):
        load_config(TRAIN_RECIPE, ["rollout.chunk_tokens=-5"])


def test_misspelt_key_is_named_with_a_suggestion(tmp_path):
    raw = yaml.safe_load(TRAIN_RECIPE.read_text())
    raw["rollout"]["chunk_tokns"] = 5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.chunk_tokns'.*did you mean 'rollout\.chunk_tokens'"):
        load_config(bad)


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"rollout\.truncation = 'middle'.*'head', 'tail', 'center' or 'center_chunks'"):
        load_config(None, ["rollout.truncation=middle"])


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match="unknown key 'trainer'"):
        load_config(None, ["trainer.lr=1"])


def test_malformed_override_and_missing_recipe():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["rollout.chunk_tokens"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/recipe.yaml")


def test_expansion_factor_must_cover_memagent_turns():
    with pytest.raises(ConfigError, match="train_sample_expansion_factor"):
        load_config(None, ["rollout.max_chunks=8", "queue.train_sample_expansion_factor=4"])


def test_final_template_may_not_see_the_chunk():
    with pytest.raises(ConfigError, match="must not contain"):
        load_config(None, ["rollout.final_template='{question} {memory} {chunk}'"])


def test_yaml_round_trip():
    cfg = load_config(TRAIN_RECIPE)
    again = Config.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


class ExtendedConfig(Config):
    extra_section: dict = {}


def test_config_class_plugin(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"plugins": {"config_class": f"{__name__}:ExtendedConfig"},
                                      "extra_section": {"a": 1}}))
    cfg = load_config(recipe)
    assert isinstance(cfg, ExtendedConfig) and cfg.extra_section == {"a": 1}


def test_import_object_errors_are_clear():
    assert import_object("memrl.config:Config") is Config
    with pytest.raises(ConfigError, match="cannot import module"):
        import_object("memrl.nope:thing")
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        import_object("memrl.config:Nope")


def test_ray_section_wants_one_server_url_per_rollout_worker():
    with pytest.raises(ConfigError, match="2 URLs for 3 rollout workers"):
        load_config(None, ["ray.num_rollout_workers=3", "ray.rollout_server_urls=[http://a,http://b]"])


def test_ray_gpus_resolve_by_cluster_and_placement():
    ray = load_config(None, []).ray
    assert ray.gpus(0) == (0.0, 0.0)
    assert ray.gpus(8) == (1.0, 1.0)
    colocated = load_config(None, ["ray.placement=colocated", "ray.rollout_num_gpus=0.25"]).ray
    assert colocated.gpus(8) == (0.5, 0.25)


def test_fsdp_needs_the_ray_runtime():
    with pytest.raises(ConfigError, match="train.runtime = 'ray'"):
        load_config(None, ["train.strategy=fsdp"])
    assert load_config(None, ["train.strategy=fsdp", "train.runtime=ray"]).train.strategy == "fsdp"


def test_training_and_eval_recipes_prompt_alike():
    # One final prompt for training and evaluation (PITFALLS): a policy trained on one wording and
    # evaluated on another measures the wording, not the policy.
    train = load_config(TRAIN_RECIPE).rollout
    evaluation = load_config(EVAL_RECIPE).rollout
    for key in ("memory_template", "final_template", "no_memory_text", "enable_thinking", "temperature", "top_p"):
        assert getattr(train, key) == getattr(evaluation, key), key


def test_row_group_size_must_divide_the_grpo_group():
    # rows per rollout = n_samples x turns: only a divisor of n_samples splits every rollout evenly
    with pytest.raises(ConfigError, match="does not divide rollout.n_samples = 8"):
        load_config(None, ["queue.train_data_group_size=3"])
    assert load_config(None, ["queue.train_data_group_size=4"]).queue.train_data_group_size == 4
