"""The `task:` section is the configured task's (issue 36): its `Settings` class validates it, eval sets override
it through the same class, `memrl config` lists it, and the framework's defaults ask the task instead of naming
MemAgent's fields (the comparability identity, Dr. GRPO's normaliser)."""

import hashlib
import json

import pytest
import yaml
from pydantic import Field
from typer.testing import CliRunner

from memrl.cli import app
from memrl.config import ConfigError, TaskSettings, config_from_dict, load_config
from memrl.eval.results import eval_format
from memrl.task import Task
from memrl.train.partition import loss_scale_factor

SINGLE = "memrl.tasks.single_turn:SingleTurnTask"


class HopsSettings(TaskSettings):
    hops: int = Field(2, gt=0, description="Hops between documents.")
    prompt: str = Field("Q: {question}", description="The prompt.")
    verbose: bool = Field(False, description="A switch.")


class HopsTask(Task):
    Settings = HopsSettings

    def max_response_tokens(self, cfg):
        return 3 * cfg.task.final_tokens


class DictSettingsTask(Task):
    Settings = dict


HOPS = f"{__name__}:HopsTask"


def test_the_task_section_is_validated_by_the_configured_tasks_settings():
    cfg = load_config(None, [f"plugins.task={HOPS}", "task.hops=3", "task.final_tokens=9"])
    assert type(cfg.task) is HopsSettings and (cfg.task.hops, cfg.task.final_tokens) == (3, 9)
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg  # the resolved YAML keeps the task's own keys
    with pytest.raises(ConfigError, match=r"task\.hops = 0: .*greater than 0"):
        load_config(None, [f"plugins.task={HOPS}", "task.hops=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'task.hop' \(did you mean 'task.hops'\?\); allowed here: "
                                          r"answer_after_think, answer_extractor, enable_thinking, final_tokens, hops, "
                                          r"prompt, reward_timeout_s, verbose"):
        load_config(None, [f"plugins.task={HOPS}", "task.hop=3"])
    # MemAgent's keys are MemAgent's: the single-turn task (the base Settings) has none of them.
    assert type(load_config(None, [f"plugins.task={SINGLE}"]).task) is TaskSettings
    with pytest.raises(ConfigError, match=r"unknown key 'task.max_chunks'"):
        load_config(None, [f"plugins.task={SINGLE}", "task.max_chunks=2"])
    assert load_config(None, ["task.max_chunks=2"]).task.max_chunks == 2  # the default task, MemAgent


def test_settings_that_are_no_task_settings_are_refused_in_one_line():
    spec = f"{__name__}:DictSettingsTask"
    with pytest.raises(ConfigError, match=r"its Settings is <class 'dict'>, not a subclass of "
                                          r"memrl.config.TaskSettings"):
        load_config(None, [f"plugins.task={spec}"])
    result = CliRunner().invoke(app, ["config", "--set", f"plugins.task={spec}"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_an_eval_sets_task_settings_are_validated_by_the_same_class():
    sets = "eval.sets=[{name: long, file: a.jsonl, task: {hops: 5}}]"
    cfg = load_config(None, [f"plugins.task={HOPS}", sets])
    assert cfg.task_with(cfg.eval.sets[0].task) == HopsSettings(hops=5)
    assert cfg.task_with({}) is cfg.task
    with pytest.raises(ConfigError, match=r"eval\.sets\.0\.task\.hops: .*greater than 0"):
        load_config(None, [f"plugins.task={HOPS}", sets.replace("5", "0")])


def test_the_eval_format_records_the_tasks_own_settings_whatever_their_names(tiny_tokenizer):
    fmt = eval_format(load_config(None, [f"plugins.task={HOPS}", "task.hops=3"]), tiny_tokenizer, [0])
    assert fmt["hops"] == 3 and "verbose" not in fmt  # a switch off is left out: older runs resume
    assert fmt["prompt_sha256"] == hashlib.sha256(json.dumps("Q: {question}").encode()).hexdigest()
    assert eval_format(load_config(None, [f"plugins.task={HOPS}", "task.verbose=true"]),
                       tiny_tokenizer, [0])["verbose"] is True
    single = eval_format(load_config(None, [f"plugins.task={SINGLE}"]), tiny_tokenizer, [0])
    assert set(fmt) - set(single) == {"hops", "prompt_sha256"}  # the rest is what every task shares
    memagent = eval_format(load_config(None), tiny_tokenizer, [0])
    # exactly what MemAgent recorded before task settings were the task's: its evaluations resume
    assert {"chunk_tokens", "memory_tokens", "max_chunks", "truncation", "memory_template_sha256",
            "final_template_sha256", "no_memory_text_sha256"} == set(memagent) - set(single)
    # a setting marked IDENTITY_WHEN_CHANGED (the layout, recorded by no earlier release) only when changed
    layout = eval_format(load_config(None, ["task.prompt_layout=chunk_first"]), tiny_tokenizer, [0])
    assert set(layout) - set(memagent) == {"prompt_layout"} and layout["prompt_layout"] == "chunk_first"


def test_dr_grpos_normaliser_asks_the_task():
    assert loss_scale_factor(load_config(None, [f"plugins.task={HOPS}", "task.final_tokens=7"])) == 21.0
    assert loss_scale_factor(load_config(None, [f"plugins.task={SINGLE}", "task.final_tokens=7"])) == 7.0
    assert loss_scale_factor(load_config(None, ["task.memory_tokens=100", "task.final_tokens=7"])) == 100.0


def test_memrl_config_lists_the_configured_tasks_settings():
    result = CliRunner().invoke(app, ["config", "--set", f"plugins.task={HOPS}"])
    assert result.exit_code == 0, result.output
    assert "  task.hops: int (> 0) = 2\n      Hops between documents.\n" in result.output
    assert "task.final_tokens" in result.output and "task.chunk_tokens" not in result.output
