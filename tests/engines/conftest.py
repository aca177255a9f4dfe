"""Fixtures shared by the engine tests."""

import pytest
import torch
from numerics import sharp_model


@pytest.fixture(scope="module")
def one_torch_thread():
    """A 100k-parameter model gains nothing from intra-op threads; on a busy 2-core machine they only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    """The sharp tiny model (numerics.sharp_model), built once per test module; a module defining its own
    `model` fixture overrides this one."""
    return sharp_model()
