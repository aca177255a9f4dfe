"""`MemrlError`: the base of every error a user fixes by changing an argument, a file or a setting.

Each module keeps its own named error class (`ConfigError`, `DataError`, ...), derived from `MemrlError`
and from the built-in it has always been (`ValueError`, `RuntimeError`, ...), so `except ValueError` in
callers still works. The CLI reports any `MemrlError` as one line with exit code 2; any other exception is
a bug and keeps its traceback. One base instead of a list of names, so no new error class can be forgotten.
This module imports nothing, so the CLI can catch the base without loading the library.
"""

from __future__ import annotations


class MemrlError(Exception):
    """An expected error: its message says what to change (an argument, a file, a config value)."""
