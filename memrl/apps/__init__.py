"""The app layer: commands built on the core (`memrl demo`, `demo-long`, `demo-consistency`, `memrl env`).
The core never imports it, and it uses only public names (tests/apps/test_public_names.py), so the core
can change its internals without breaking it."""
