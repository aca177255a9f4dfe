"""Fixtures of the data tests: the HotpotQA samples in ../shared (skipped where absent) and the `memrl` app."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def app():
    """The `memrl` app itself: its handler turns expected errors into one line and exit 2."""
    from memrl.cli import app

    return app


def _hotpot_file(shared_dir, name: str, what: str):
    path = shared_dir / "data" / "hotpotqa" / name
    if not path.is_file():
        pytest.skip(f"{what} not found at {path}")
    return path


@pytest.fixture(scope="module")
def train_file(shared_dir):
    return _hotpot_file(shared_dir, "hotpot_train_sample100.json", "HotpotQA train sample")


@pytest.fixture(scope="module")
def dev_file(shared_dir):
    return _hotpot_file(shared_dir, "hotpot_dev_distractor_first200.json", "HotpotQA dev records")
