import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memrl.cli import app
from memrl.config import Config, ConfigError, import_object, load_config
from memrl.task import Task

ROOT = Path(__file__).resolve().parents[1]
TRAIN_RECIPE = ROOT / "recipes" / "qwen3-0.6b-hotpotqa.yaml"
EVAL_RECIPE = ROOT / "recipes" / "ruler-hqa-eval.yaml"


def test_training_recipe_has_the_seed_values():
    cfg = load_config(TRAIN_RECIPE)
    assert cfg.model.path == "Qwen/Qwen3-0.6B"
    assert cfg.model.revision == "c1899de289a04d12100db370d81485cdf75e47ca"
    t, s = cfg.task, cfg.sampling
    assert ((t.chunk_tokens, t.memory_tokens, t.final_tokens, t.max_chunks, t.enable_thinking)
            == (512, 128, 64, 4, False))
    assert (s.n_samples, s.temperature, s.top_p, s.seed) == (8, 1.0, 1.0, 4242)
    assert cfg.algorithm.credit == "split"
    assert (cfg.train.lr, cfg.algorithm.kl_coef) == (1e-6, 0.001)


def test_eval_recipe_has_the_seed_values():
    cfg = load_config(EVAL_RECIPE)
    t, s = cfg.task, cfg.sampling
    assert ((t.chunk_tokens, t.memory_tokens, t.final_tokens, t.max_chunks, t.enable_thinking)
            == (2048, 1024, 256, 64, False))
    assert (s.temperature, s.top_p, s.seed) == (1.0, 1.0, 4242)
    assert cfg.eval.concurrency == 64


def test_override_sets_nested_values_with_yaml_types():
    cfg = load_config(TRAIN_RECIPE, ["task.chunk_tokens=256", "algorithm.credit=share", "train.pad_to_dp=true"])
    assert cfg.task.chunk_tokens == 256
    assert cfg.algorithm.credit == "share"
    assert cfg.train.pad_to_dp is True


def test_negative_value_names_the_key():
    with pytest.raises(ConfigError, match=r"task\.chunk_tokens = -5"):
        load_config(TRAIN_RECIPE, ["task.chunk_tokens=-5"])


def test_misspelt_key_is_named_with_a_suggestion(tmp_path):
    raw = yaml.safe_load(TRAIN_RECIPE.read_text())
    raw["task"]["chunk_tokns"] = 5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"unknown key 'task\.chunk_tokns'.*did you mean 'task\.chunk_tokens'"):
        load_config(bad)


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"task\.truncation = 'middle'.*'head', 'tail', 'center' or 'center_chunks'"):
        load_config(None, ["task.truncation=middle"])


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match="unknown key 'trainer'"):
        load_config(None, ["trainer.lr=1"])


def test_malformed_override_and_missing_recipe():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["task.chunk_tokens"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/recipe.yaml")


def test_expansion_factor_must_cover_memagent_turns():
    with pytest.raises(ConfigError, match="train_sample_expansion_factor"):
        load_config(None, ["task.max_chunks=8", "queue.train_sample_expansion_factor=4"])


def test_final_template_may_not_see_the_chunk():
    with pytest.raises(ConfigError, match="must not contain"):
        load_config(None, ["task.final_template='{question} {memory} {chunk}'"])


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


def test_lora_with_fsdp_names_the_runtime_first_then_the_missing_support():
    # The LoRA check relies on the fsdp check running before it (it no longer tests the runtime itself).
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match="train.runtime = 'ray'"):
        load_config(None, ["model.lora.rank=4", "train.strategy=fsdp"])
    with pytest.raises(ConfigError, match="model.lora with train.strategy = 'fsdp' is not supported yet"):
        load_config(None, ["model.lora.rank=4", "train.strategy=fsdp", "train.runtime=ray"])


def test_training_and_eval_recipes_prompt_alike():
    # One final prompt for training and evaluation (docs/design.md, pitfall "Different scorer in evaluation"): a policy
    # trained on one wording and evaluated on another measures the wording, not the policy.
    train = load_config(TRAIN_RECIPE)
    evaluation = load_config(EVAL_RECIPE)
    for key in ("memory_template", "final_template", "no_memory_text", "enable_thinking"):
        assert getattr(train.task, key) == getattr(evaluation.task, key), key
    assert ((train.sampling.temperature, train.sampling.top_p)
            == (evaluation.sampling.temperature, evaluation.sampling.top_p))


def _fields_accepting(kind):
    """(key, how many items: None for a scalar) of every section field whose values are of type `kind`."""
    from typing import get_args, get_origin

    from memrl.config.base import _accepted_scalars

    out = []
    for section, section_field in Config.model_fields.items():
        for name, field in section_field.annotation.model_fields.items():
            accepted = _accepted_scalars(field.annotation)
            if kind in accepted and (kind is not int or float not in accepted):
                origin = get_origin(field.annotation)
                items = (len(get_args(field.annotation)) if origin is tuple else 1 if origin is list
                         else "outcome" if origin is dict else None)  # a dict: the value of one key
                out.append((f"{section}.{name}", items))
    return out


def _override(key, items, value):
    if isinstance(items, str):
        return f"{key}.{items}={value}"
    return f"{key}={value}" if items is None else f"{key}=[{', '.join([value] * items)}]"


FLOAT_FIELDS = _fields_accepting(float)
INT_FIELDS = _fields_accepting(int)
BOOL_FIELDS = _fields_accepting(bool)


def test_every_kind_of_field_is_found():
    assert ("train.lr", None) in FLOAT_FIELDS and ("train.adam_betas", 2) in FLOAT_FIELDS
    assert ("algorithm.reward_weights", "outcome") in FLOAT_FIELDS  # a dict of floats: each value checked
    assert ("sampling.n_samples", None) in INT_FIELDS and ("eval.limit", None) in INT_FIELDS
    assert ("train.pad_to_dp", None) in BOOL_FIELDS


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "'nan'"])
@pytest.mark.parametrize("key, items", FLOAT_FIELDS, ids=[k for k, _ in FLOAT_FIELDS])
def test_non_finite_floats_are_config_errors(key, items, value):
    # train.lr=.inf turned every weight into NaN with exit 0; queue.timeout_s=.inf overflowed a later wait.
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}(\.\w+)? = .*finite number"):
        load_config(None, [_override(key, items, value)])


@pytest.mark.parametrize("value", ["true", "false", "1.5", "8.0", "'8'"])
@pytest.mark.parametrize("key, items", INT_FIELDS, ids=[k for k, _ in INT_FIELDS])
def test_int_fields_take_only_integers(key, items, value):
    # Lax mode made `sampling.n_samples=true` 1 and `8.0` 8.
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} = .*(is a bool where a number|is not a whole number)"):
        load_config(None, [_override(key, items, value)])


@pytest.mark.parametrize("value", ["1", "0", "'yes'", "'true'", "1.0"])
@pytest.mark.parametrize("key, items", BOOL_FIELDS, ids=[k for k, _ in BOOL_FIELDS])
def test_bool_fields_take_only_true_or_false(key, items, value):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} = .*is not a bool; write true or false"):
        load_config(None, [_override(key, items, value)])


@pytest.mark.parametrize("key", ["train.lr", "sampling.temperature", "train.adam_betas"])
def test_floats_take_true_or_false_never(key):
    value = "[true, 0.9]" if key == "train.adam_betas" else "true"
    with pytest.raises(ConfigError, match="is a bool where a number belongs"):
        load_config(None, [f"{key}={value}"])


def test_floats_still_take_ints_and_exponents_without_a_dot():
    # `lr: 1` is a float to a reader; YAML 1.1 reads `1e-6` (no dot) as a string, which pydantic parses.
    cfg = load_config(None, ["train.lr=1", "train.weight_decay=1e-2", "train.adam_betas=[0, 1]", "train.pad_to_dp=yes"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.adam_betas) == (1.0, 0.01, (0.0, 1.0))
    assert cfg.train.pad_to_dp is True  # YAML 1.1 itself reads yes as true; only the quoted text is refused
    assert load_config(None, ["eval.limit=null", "algorithm.dual_clip=null"]).eval.limit is None


def test_assignment_is_checked_too():
    cfg = Config()
    with pytest.raises(ValueError, match="finite number"):
        cfg.train.lr = float("inf")
    with pytest.raises(ValueError, match="not a whole number"):
        cfg.sampling.n_samples = 4.0


RETIRED = [("algorithm.tis_cap", "is replaced by algorithm.rollout_is=token + rollout_is_threshold=C"),
           ("train.lr_warmup_steps_ratio", "is replaced by train.warmup_steps"),
           ("queue.train_data_group_size", "is removed: the trainer takes each rollout's rows all at once")]


@pytest.mark.parametrize("value", ["2", "0.1", "null"])
@pytest.mark.parametrize("key, says", RETIRED, ids=[k for k, _ in RETIRED])
def test_a_retired_key_is_refused_naming_its_replacement(key, says, value):
    # One knob per setting: the older spelling stops the load, even when null, and says what to write.
    with pytest.raises(ConfigError, match=re.escape(f"{key} {says}")):
        load_config(None, [f"{key}={value}"])
    section, name = key.split(".")
    assert name not in type(getattr(Config(), section)).model_fields  # refused, not a field kept alongside


def test_every_recipe_validates():
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        load_config(recipe)


def test_an_overlong_buffer_longer_than_the_answer_limit_is_refused():
    # It was clamped silently to the limit: B = 100 with task.final_tokens = 64 shaped a 32-token answer's
    # reward to 1 - 32/64 = 0.5. verl refuses it too; B equal to the limit is allowed (penalty from 0 tokens).
    with pytest.raises(ConfigError, match=r"overlong_buffer_len = 100 .*task\.final_tokens = 64"):
        load_config(None, ["algorithm.overlong_buffer_len=100", "task.final_tokens=64"])
    assert load_config(None, ["algorithm.overlong_buffer_len=64",
                              "task.final_tokens=64"]).algorithm.overlong_buffer_len == 64


def test_max_num_gen_batches_has_no_unlimited_setting():
    # verl's 0 means "generate until the batch is full", which never ends when every group has equal
    # rewards; memrl refuses it with what to set instead of pydantic's bare "greater than 0".
    with pytest.raises(ConfigError, match=r"max_num_gen_batches = 0: .*'unlimited'.*set a cap such as 10"):
        load_config(None, ["algorithm.max_num_gen_batches=0"])
    assert load_config(None, ["algorithm.max_num_gen_batches=1"]).algorithm.max_num_gen_batches == 1


# The rollout section split in three (issue 25): old keys are spelt from the table here, so that the rename script,
# which rewrites `rollout.<key>` text, leaves this test as it is.
OLD = "rollout"
SPLIT_BY_HAND = {"temperature": "sampling.temperature", "engine": "engine.kind", "chunk_tokens": "task.chunk_tokens",
                 "server_url": "engine.server_url", "reward_timeout_s": "task.reward_timeout_s",
                 "seed": "sampling.seed"}


def rollout_table():
    """The old rollout keys of the default task (its Settings hold what the old section had of the task)."""
    from memrl.config import rollout_moved

    return rollout_moved(type(Config().task))


def test_the_rollout_table_names_every_field_of_the_three_sections():
    moved = rollout_table()
    assert {k: moved[k] for k in SPLIT_BY_HAND} == SPLIT_BY_HAND  # rename.md's examples
    fields = {f"{s}.{name}" for s in ("sampling", "engine", "task") for name in type(getattr(Config(), s)).model_fields}
    assert set(moved.values()) == fields
    for new in moved.values():  # each new place is a key the loader accepts
        section, name = new.split(".")
        assert name in type(getattr(Config(), section)).model_fields


def _moved_keys():
    return sorted(rollout_table().items())


@pytest.mark.parametrize("old, new", _moved_keys(), ids=[k for k, _ in _moved_keys()])
def test_every_old_rollout_key_is_refused_naming_its_new_place(tmp_path, old, new):
    # Refused both as --set and as a key of a YAML `rollout:` section, even when null.
    says = f"{OLD}.{old} moved to {new}"
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, [f"{OLD}.{old}=null"])
    recipe = tmp_path / "old.yaml"
    recipe.write_text(yaml.safe_dump({OLD: {old: None}, "train": {"lr": 1e-6}}))
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(recipe)
    assert OLD not in Config.model_fields


def test_an_old_rollout_section_is_refused_in_one_line_naming_each_key(tmp_path):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"{OLD}:\n  n_samples: 4\n  engine: openai\n  chunk_tokns: 5\n")
    result = CliRunner().invoke(app, ["config", "--recipe", str(recipe)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"{OLD}.n_samples moved to sampling.n_samples; {OLD}.engine moved to engine.kind" in result.output
    assert f"{OLD}.chunk_tokns is no key of sampling, engine or task (did you mean {OLD}.chunk_tokens, now " \
           "task.chunk_tokens?)" in result.output
    with pytest.raises(ConfigError, match="the rollout section is split into sampling, engine and task"):
        load_config(None, [f"{OLD}={{}}"])


class _NeedsArguments(Task):
    def __init__(self, hops: int) -> None:
        self.hops = hops


class _NoTask:
    pass


@pytest.mark.parametrize("spec, found", [
    ("os:getcwd", "is a builtin_function_or_method ('getcwd'), not a class"),
    ("builtins:object", "is the class builtins.object, which does not derive from memrl.task.Task"),
    ("memrl.task:DEFAULT_EXTRACTOR", "is a str value ('boxed'), not a class"),
    (f"{__name__}:_NoTask", f"is the class {__name__}._NoTask, which does not derive from memrl.task.Task"),
    (f"{__name__}:_NeedsArguments", "_NeedsArguments() needs arguments (missing a required argument: 'hops')"),
])
def test_a_task_path_naming_no_task_class_is_one_line_naming_what_it_found(spec, found):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"plugins.task={spec}"])
    assert f"plugins.task = '{spec}'" in str(info.value) and found in str(info.value)
    result = CliRunner().invoke(app, ["config", "--set", f"plugins.task={spec}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and found in result.output


class _CountedTask(Task):
    built = 0

    def __init__(self) -> None:
        type(self).built += 1


def test_the_task_is_built_once_per_process_whatever_asks_for_it():
    """Loading a config (validate_config), sizing the queue and a command's own task share one instance."""
    from memrl.task import load_task, rows_per_trajectory

    cfg = load_config(None, [f"plugins.task={__name__}:_CountedTask"])
    assert _CountedTask.built == 1
    assert rows_per_trajectory(cfg) == 1 and load_task(cfg) is load_task(cfg)
    load_config(None, [f"plugins.task={__name__}:_CountedTask", "sampling.n_samples=2"])
    assert _CountedTask.built == 1


def test_a_near_miss_in_an_eval_set_gets_did_you_mean_and_the_sets_keys():
    """An eval set's unknown key: a near miss of its own keys is a typo (did you mean, the set's keys listed);
    anything else is a task setting that belongs under the set's `task:` mapping."""
    with pytest.raises(ConfigError) as typo:
        load_config(None, ["eval.sets=[{name: a, file: x.jsonl, sampels: 2}]"])
    assert "did you mean 'eval.sets.0.samples'" in str(typo.value)
    assert "allowed here: file, limit, name, samples, task, temperature" in str(typo.value)
    with pytest.raises(ConfigError, match=r"goes under its task mapping, e\.g\. task: \{max_chunks"):
        load_config(None, ["eval.sets=[{name: a, file: x.jsonl, max_chunks: 2}]"])
