"""The step every sm_90a compile test shares: its file's kernels compiled in one subprocess
(``kernels/sm90_check.compile_in_subprocess``, TRITON_INTERPRET=0, no GPU needed), cached per file, and
a skip where this machine's Triton has no NVIDIA backend.

The compiles are CPU-bound ptxas runs (~5 min for the whole suite). ``start_background`` (called by
conftest once collection is done) queues every collected file's compile on one worker thread, so they
run on a second core while the interpreter tests run on the first; a test whose file has not started
yet takes its file off the queue and compiles it in the foreground, so nothing waits behind the queue.
"""

import concurrent.futures as cf
import threading

import pytest

from titan_megamoe.kernels.sm90_check import compile_in_subprocess, nvidia_backend_reason

_lock = threading.Lock()
_futures: dict[str, cf.Future] = {}
_pool: cf.ThreadPoolExecutor | None = None


def start_background(scripts: list[str]) -> None:
    """Queue the compile subprocess of each test file in ``scripts`` (in order) on one worker thread.
    A no-op where the NVIDIA backend is missing (the tests skip there)."""
    global _pool
    if nvidia_backend_reason() or not scripts:
        return
    with _lock:
        if _pool is None:
            _pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sm90-compile")
        for s in scripts:
            if s not in _futures:
                _futures[s] = _pool.submit(compile_in_subprocess, s)


def stop_background() -> None:
    """Drop the compiles no test asked for (a ``-k`` run) and wait for the one running."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _results(script: str) -> dict:
    with _lock:
        fut = _futures.get(script)
        if fut is None or fut.cancel():  # not queued, or still waiting its turn: compile here, now
            fut = cf.Future()
            fut.set_running_or_notify_cancel()
            _futures[script] = fut
            mine = True
        else:
            mine = False
    if mine:
        try:
            fut.set_result(compile_in_subprocess(script))
        except BaseException as e:  # the failure reaches every test of the file, not only the first
            fut.set_exception(e)
    return fut.result()


def sm90_result(script: str, label: str) -> dict:
    """The compile result of case ``label`` of test file ``script`` (its ``compile-sm90`` mode); skips
    the calling test when the NVIDIA backend is missing."""
    reason = nvidia_backend_reason()
    if reason:
        pytest.skip(reason)
    return _results(str(script))[label]
