"""Markers and the Triton mode: cuda / multigpu tests skip on machines without them, with the reason
printed; on a CPU machine Triton kernels run in the interpreter, on a GPU machine compiled."""

import os

import pytest
import torch

# Decided once, before any test module imports triton: kernel test files only setdefault it.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and ngpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible: torch.cuda.device_count() == 0)"))
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs (visible: {ngpu})"))
