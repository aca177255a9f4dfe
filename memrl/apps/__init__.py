"""The app layer: commands built on the core (`memrl demo`, `demo-long`, `demo-consistency`, `memrl env`).

The core never imports these modules; they use the core only through its public names (no `_private`
import from any module, theirs included: tests/apps/test_public_names.py checks it), so the core can change
its internals without breaking them.
"""
