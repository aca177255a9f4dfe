"""`MemrlError`: the base of every error a user fixes by changing an argument, a file or a setting.

Each module keeps its own named class (`ConfigError`, `DataError`, ...) derived from it and from its
built-in (`ValueError`, ...); the CLI reports any `MemrlError` as one line with exit code 2. One base
instead of a list of names, so no new class can be forgotten; this module imports nothing.
"""

from __future__ import annotations


class MemrlError(Exception):
    """An expected error: its message says what to change (an argument, a file, a config value)."""
