"""scripts/step_gaps.py's trace parsing on synthetic chrome traces (the script itself needs a GPU)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "step_gaps", Path(__file__).resolve().parents[1] / "scripts" / "step_gaps.py")
step_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_gaps)


def _trace(head_start: bool, steps: int = 2):
    """Kernels on one timeline: [spin] flush [spin] k0 k1 [spin] b0 per step; launch ends and syncs set so
    that k0 is launched 30 us after the host start, k1 launched late, b0 launched early."""
    ev, t, corr = [], 1000.0, 0

    def kernel(name, dur, launch_end):
        nonlocal t, corr
        corr += 1
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_end - 5, "dur": 5,
                   "args": {"correlation": corr}})
        t += dur

    for s in range(steps):
        kernel("spin_kernel", 1, t)
        kernel("flush", 50, t)
        t += 10
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": t - 20, "dur": 20})
        host0 = t
        if head_start:
            kernel("spin_kernel", 400, t)
        t += 40
        kernel("k0", 100 + s, host0 + 30)
        t += 7
        kernel("k1", 200, t + 3)  # launch ends 3 us after the gap began: launched late
        kernel("spin_kernel", 1, t)
        kernel("b0", 300, host0 + 60)
        t += 100
    return {"traceEvents": ev}


@pytest.mark.parametrize("head_start", [False, True])
def test_phases_split_steps_and_rows_measure_gaps(head_start):
    steps = step_gaps._phases(_trace(head_start), head_start=head_start)
    assert len(steps) == 2
    fwd, bwd, host0 = steps[0]
    assert [k["name"] for k in fwd] == ["k0", "k1"] and [k["name"] for k in bwd] == ["b0"]
    # as main(): the head-start pass measures the forward's first gap from its own start (the sleep's end)
    starts = [s[0][0]["ts"] if head_start else s[2] for s in steps]
    rows = step_gaps._rows([s[0] for s in steps], starts, [s[2] for s in steps])
    assert [r["dur_us"] for r in rows] == [100.5, 200]
    assert rows[0]["gap_before_us"] == (0 if head_start else 40)
    assert rows[1]["gap_before_us"] == 7 and rows[1]["launched_late"] == 2
    assert rows[0]["launched_late"] == (0 if head_start else 2) and rows[0]["launched_at_us"] == 30
    assert rows[0]["started_at_us"] == (440 if head_start else 40)


def test_pair_adds_head_start_durations_only_for_the_same_kernels():
    idle = step_gaps._rows([s[0] for s in step_gaps._phases(_trace(False))], [0, 0], [0, 0])
    hs = step_gaps._rows([s[0] for s in step_gaps._phases(_trace(True), head_start=True)], [0, 0], [0, 0])
    for r in hs:
        r["dur_us"] -= 10
    step_gaps._pair(idle, hs)
    assert [r["head_start_dur_us"] for r in idle] == [90.5, 190]
    assert step_gaps._summary(idle)["head_start_kernel_us"] == 280.5
    other = [dict(r, name="x") for r in hs]
    fresh = step_gaps._rows([s[0] for s in step_gaps._phases(_trace(False))], [0, 0], [0, 0])
    step_gaps._pair(fresh, other)
    assert "head_start_dur_us" not in fresh[0]
