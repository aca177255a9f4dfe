"""Fixtures of the data tests: the HotpotQA samples in ../shared (skipped where absent) and the `memrl` app."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def app():
    """The `memrl` app itself: its handler turns expected errors into one line and exit 2."""
    from memrl.cli import app

    return app


@pytest.fixture(scope="module")
def train_file(shared_dir):
    path = shared_dir / "data" / "hotpotqa" / "hotpot_train_sample100.json"
    if not path.is_file():
        pytest.skip(f"HotpotQA train sample not found at {path}")
    return path


@pytest.fixture(scope="module")
def dev_file(shared_dir):
    path = shared_dir / "data" / "hotpotqa" / "hotpot_dev_distractor_first200.json"
    if not path.is_file():
        pytest.skip(f"HotpotQA dev records not found at {path}")
    return path
