"""Typed, validated configuration: one pydantic model per section, YAML recipes, `--set a.b=v` overrides.

Unknown keys and bad values raise `ConfigError` naming the key, the value and what is allowed, so a typo never
silently becomes a default. Each module's `__all__` lists what it adds to `memrl.config`.
"""

from memrl.config.base import *  # noqa: F403
from memrl.config.load import *  # noqa: F403
from memrl.config.root import *  # noqa: F403
from memrl.config.sections import *  # noqa: F403
from memrl.config.training import *  # noqa: F403
