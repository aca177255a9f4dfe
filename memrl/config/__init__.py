"""Typed, validated configuration: one pydantic model per section, YAML recipes, `--set a.b=v` overrides.

Every field has a description (`memrl config` lists them all, with types and defaults; `memrl config
--recipe FILE` validates a recipe and shows its values). Unknown keys and bad values raise
`ConfigError` naming the key, the value and what is allowed, so a typo never silently becomes a default.
Modules: base (Section, ConfigError), sections and training (the sections), root (Config and its
checks across sections), load (YAML, overrides, error messages).
"""

from memrl.config.base import ConfigError, Section, import_object
from memrl.config.load import (
    apply_overrides,
    check_model_path,
    config_from_dict,
    load_config,
    load_pretrained,
    load_yaml,
    parse_override,
)
from memrl.config.root import ROLLOUT_MOVED, Config
from memrl.config.sections import (
    DEFAULT_FINAL_TEMPLATE,
    DEFAULT_MEMORY_TEMPLATE,
    DEFAULT_NO_MEMORY_TEXT,
    DataConfig,
    EngineConfig,
    EvalConfig,
    EvalSetConfig,
    LoraConfig,
    ModelConfig,
    PluginConfig,
    QueueConfig,
    RayConfig,
    SamplingConfig,
    TaskConfig,
)
from memrl.config.training import AlgorithmConfig, TrainConfig

__all__ = [
    "DEFAULT_FINAL_TEMPLATE", "DEFAULT_MEMORY_TEMPLATE", "DEFAULT_NO_MEMORY_TEXT", "ROLLOUT_MOVED",
    "AlgorithmConfig", "Config", "ConfigError", "DataConfig", "EngineConfig", "EvalConfig", "EvalSetConfig",
    "LoraConfig", "ModelConfig", "PluginConfig", "QueueConfig", "RayConfig", "SamplingConfig", "Section",
    "TaskConfig", "TrainConfig", "apply_overrides", "check_model_path", "config_from_dict", "import_object",
    "load_config", "load_pretrained", "load_yaml", "parse_override",
]
