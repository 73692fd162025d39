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


def pytest_collection_finish(session):
    # The sm_90a compile subprocesses start now, on a second core (tests/_sm90.py says how).
    import _sm90

    scripts = []
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and getattr(mod, "sm90_result", None) is _sm90.sm90_result and "sm90" in item.name:
            if mod.__file__ not in scripts:
                scripts.append(mod.__file__)
    _sm90.start_background(scripts)


def pytest_sessionfinish(session, exitstatus):
    import _sm90

    _sm90.stop_background()
