"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """Tiny matmuls are dominated by thread hand-off on a shared 2-core runner; one thread is ~10x faster."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
