"""`MemrlError`: the base of every error a user fixes by changing an argument, a file or a setting (each
module derives its own class from it and its built-in; docs/design.md). One base instead of a list of names
for the CLI to catch, so no new class can be forgotten; this module imports nothing."""

from __future__ import annotations


class MemrlError(Exception):
    """An expected error: its message says what to change (an argument, a file, a config value)."""
