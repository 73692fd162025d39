"""The step every sm_90a compile test shares: its file's kernels compiled in one subprocess
(``kernels/sm90_check.compile_in_subprocess``, TRITON_INTERPRET=0, no GPU needed), cached per file, and
a skip where this machine's Triton has no NVIDIA backend."""

import functools

import pytest

from titan_megamoe.kernels.sm90_check import compile_in_subprocess, nvidia_backend_reason


@functools.lru_cache(maxsize=None)
def _results(script: str) -> dict:
    return compile_in_subprocess(script)


def sm90_result(script: str, label: str) -> dict:
    """The compile result of case ``label`` of test file ``script`` (its ``compile-sm90`` mode); skips
    the calling test when the NVIDIA backend is missing."""
    reason = nvidia_backend_reason()
    if reason:
        pytest.skip(reason)
    return _results(str(script))[label]
