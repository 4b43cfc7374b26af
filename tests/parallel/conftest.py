"""A tiny random Llama (GQA, 3 layers) saved to a folder, so worker processes can load it too."""

from __future__ import annotations

import pytest
import torch

from kvserve.models import load_model
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=3, seed=11)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("runahead") / "model", SPEC)
    return folder, load_model(folder, torch.float32)


def prompt(n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def even(n: int, p: int) -> tuple[int, ...]:
    return tuple(round(n * i / p) for i in range(p + 1))
