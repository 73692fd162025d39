"""Markers: cuda / multigpu tests skip on machines without them, with the reason printed."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and ngpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible: torch.cuda.device_count() == 0)"))
        if "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs (visible: {ngpu})"))
