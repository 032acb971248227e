"""CUDA-marked tests run only where a CUDA device is visible."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
