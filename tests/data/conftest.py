"""Fixtures of the data tests: the HotpotQA records memrl ships, as files, and the `memrl` app."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def app():
    """The `memrl` app itself: its handler turns expected errors into one line and exit 2."""
    from memrl.cli import app

    return app


@pytest.fixture(scope="module")
def train_file():
    """100 official HotpotQA train records (shipped: memrl.data.hotpotqa.SHIPPED_FILES, gzip-compressed)."""
    from memrl.data.hotpotqa import SHIPPED_FILES

    return SHIPPED_FILES["train"]


@pytest.fixture(scope="module")
def dev_file():
    """The first 200 official HotpotQA dev (distractor) records (shipped, gzip-compressed)."""
    from memrl.data.hotpotqa import SHIPPED_FILES

    return SHIPPED_FILES["dev"]
