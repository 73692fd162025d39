"""The fast launch path (kernels/launch.py) makes the launcher call Triton's own path makes.

Runs the package's real launchers in compiled mode on this CPU machine through the host-only sm_90a
driver (kernels/host_driver.py: Triton specializes, compiles with its bundled ptxas, and calls a
recording launcher instead of the C one), in a subprocess with TRITON_INTERPRET=0 (the interpreter
flag is fixed at import for Triton's own library functions). Each launch of a case is made three
times with the same arguments: through ``JITFunction.run``, then through the fast path on an empty
cache (a miss, which goes through Triton and fills the cache), then through the fast path again (a
hit). All three must record the same compiled kernel, grid and arguments (tensors by identity or, on the
fast path's hit, by address (``launch.POINTER_ARGS``), host
tensor descriptors by base tensor and shapes, other values by equality).
"""

from __future__ import annotations

import functools
import json
import sys

import pytest

from titan_megamoe.kernels.sm90_check import nvidia_backend_reason

CASES = ["routing_layout", "gemm1", "gemm2", "combine", "combine_misaligned", "gemm2_dgrad_tma", "quant_1x128",
         "gemm1_fp8", "gluon_gemm1_dgrad", "gluon_gemm1_fwd"]


def _same(a, b) -> bool:
    if isinstance(a, int) and hasattr(b, "data_ptr"):  # the fast path passes tensors as their addresses
        return a == b.data_ptr()
    if isinstance(b, int) and hasattr(a, "data_ptr"):
        return b == a.data_ptr()
    if hasattr(a, "data_ptr") or hasattr(b, "data_ptr"):
        return a is b
    if hasattr(a, "base") and hasattr(b, "base"):  # host TensorDescriptor: same tensor, shape, block
        return a.base is b.base and list(a.shape) == list(b.shape) and list(a.block_shape) == list(b.block_shape)
    return a == b


def _compare(ref, got) -> str | None:
    """None if the two recorded calls are the same launch, else what differs."""
    if (ref.name, ref.kernel_id, ref.grid) != (got.name, got.kernel_id, got.grid):
        return f"{ref.name}/{ref.kernel_id}/{ref.grid} vs {got.name}/{got.kernel_id}/{got.grid}"
    if len(ref.args) != len(got.args):
        return f"{len(ref.args)} vs {len(got.args)} arguments"
    bad = [i for i, (a, b) in enumerate(zip(ref.args, got.args)) if not _same(a, b)]
    return f"arguments {bad} differ" if bad else None


def _cases():
    """{case: a callable doing one launcher call with fixed CPU tensors}."""
    import torch

    from titan_megamoe.kernels import fp8_quant as q8
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels import grouped_gemm_bwd as gb
    from titan_megamoe.kernels import grouped_gemm_fp8 as g8
    from titan_megamoe.kernels.routing import build_routing_layout_triton

    g = torch.Generator().manual_seed(0)
    T, K, E, D, F = 64, 4, 8, 256, 128
    bf = torch.bfloat16
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int64)
    x = torch.randn(T, D, generator=g).to(bf)
    w1, w3 = torch.randn(E, F, D, generator=g).to(bf), torch.randn(E, F, D, generator=g).to(bf)
    w2 = torch.randn(E, D, F, generator=g).to(bf)
    scores = torch.rand(T, K, generator=g)
    lay = build_routing_layout_triton(ids, E, 128)  # nothing runs: the layout's values are garbage, its sizes right
    gu = torch.zeros(lay.n_cap, 2 * F, dtype=bf)
    h = torch.zeros(lay.n_cap, F, dtype=bf)
    y = torch.zeros(T * K, D, dtype=bf)
    flat = torch.zeros(T * K * D + 1, dtype=bf)
    y_odd = flat[1:].view(T * K, D)  # contiguous, 2 bytes past a 16-byte boundary: another specialization
    hs = torch.zeros(lay.n_cap, F, dtype=bf)
    f8 = q8.FP8_DTYPE if hasattr(q8, "FP8_DTYPE") else torch.float8_e4m3fn
    xq, xs = torch.zeros(T, D, dtype=f8), torch.ones(T, D // 128)
    w1q, w3q = torch.zeros(E, F, D, dtype=f8), torch.zeros(E, F, D, dtype=f8)
    w1s, w3s = torch.ones(E, F // 128, D // 128), torch.ones(E, F // 128, D // 128)
    fp8_cfg = dict(config=g8.fp8_config_for("gemm1", D, F, False))
    from titan_megamoe.kernels import ws_gemm as W  # Gluon kernels: launched directly (their launchers want a GPU)
    from titan_megamoe.kernels.launch import launch

    c, cf = W.CONFIGS["coop"], W.FWD_CONFIG
    dx = torch.zeros(lay.n_cap, D, dtype=bf)
    # counter_ptr: the layout's offsets, not read by the static schedule (as the launchers pass it)
    g1d_args = (W._desc(gu, (lay.n_cap, 2 * F), (128, 64)), W._desc(w1, (E * F, D), (64, c.block_n)),
                W._desc(w3, (E * F, D), (64, c.block_n)), W._desc(dx, (lay.n_cap, D), (64, c.block_n)),
                lay.row_pair, lay.tile_expert, lay.offsets, lay.offsets, E, F, D // c.block_n, c.group_m, c.stages,
                c.coop, c.producer_regs, c.consumer_regs)
    g1f_args = (x, W._desc(w1, (E * F, D), (128, 64)), W._desc(w3, (E * F, D), (128, 64)),
                W._desc(gu, (lay.n_cap, 2 * F), (64, 128)), W._desc(h, (lay.n_cap, F), (64, 128)),
                lay.row_pair, lay.tile_expert, lay.offsets, lay.offsets, E, D, F, K, F // 128, cf.group_m, cf.stages,
                128, 64, cf.producer_regs, cf.consumer_regs)
    return {
        "gluon_gemm1_dgrad": lambda: launch(W._gemm1_dgrad_ws_kernel, (4,), *g1d_args, num_warps=4, maxnreg=c.maxnreg),
        "gluon_gemm1_fwd": lambda: launch(W._gemm1_fwd_ws_kernel, (4,), *g1f_args, num_warps=4, maxnreg=cf.maxnreg),
        "routing_layout": lambda: build_routing_layout_triton(ids, E, 128),
        "gemm1": lambda: gg.gemm1_swiglu_fwd(x, w1, w3, lay, gate_up_out=gu, h_out=h),
        "gemm2": lambda: gg.gemm2_scatter_fwd(h, w2, scores, lay, out_pairs=y),
        "combine": lambda: gg.combine_topk(y, T, K),
        "combine_misaligned": lambda: gg.combine_topk(y_odd, T, K),
        "gemm2_dgrad_tma": lambda: gb.gemm2_dgrad_swiglu_bwd(x, w2, gu, scores, lay, hs_out=hs),
        "quant_1x128": lambda: q8.quantize_act_1x128(x),
        "gemm1_fp8": lambda: g8.gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, **fp8_cfg),
    }


def _check_all() -> list[dict]:
    """Subprocess body (TRITON_INTERPRET=0): one result per case, plus the hook and switch checks."""
    from triton import knobs

    from titan_megamoe.kernels import launch as L
    from titan_megamoe.kernels.host_driver import host_only_driver

    out = []
    fast = L._launch_cached

    def triton_then_fast(fn, grid, args, kwargs):
        # the same arguments three times: Triton's path, then the fast path (a miss: through Triton,
        # filling the cache) and the fast path again (a hit: the cached kernel's launcher, directly)
        fn[grid](*args, **kwargs)
        L._CACHES.pop(id(fn), None)
        fast(fn, grid, args, kwargs)
        return fast(fn, grid, args, kwargs)

    with host_only_driver() as calls:
        cases = _cases()
        L._launch_cached = triton_then_fast
        try:
            for name in CASES:
                n0 = len(calls)
                cases[name]()
                got = calls[n0:]
                diffs = [] if len(got) % 3 == 0 else ["launch count not a multiple of 3"]
                addresses = 0  # tensors Triton got that the cache hit passed as ints (POINTER_ARGS)
                for i in range(0, len(got) - 2, 3):
                    diffs += [d for d in (_compare(got[i], got[i + 1]), _compare(got[i], got[i + 2])) if d]
                    addresses += sum(hasattr(a, "data_ptr") and isinstance(b, int)
                                     for a, b in zip(got[i].args, got[i + 2].args))
                out.append(dict(label=name, launches=len(got) // 3, diffs=diffs, addresses=addresses))
        finally:
            L._launch_cached = fast
        # a launch hook (profilers): the fast path hands it the launch metadata, as Triton does
        seen = []
        hook = lambda meta: seen.append(meta.get()["name"] if meta is not None else None)  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            L.FAST_LAUNCH = False
            cases["combine"]()
            L.FAST_LAUNCH = True
            cases["combine"]()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        out.append(dict(label="hook", seen=seen))
        out.append(dict(label="cache", combine_variants=L.cached_kernels(__import__(
            "titan_megamoe.kernels.grouped_gemm", fromlist=["x"])._combine_topk_fwd_kernel)))
    return out


@functools.lru_cache(maxsize=1)
def _results() -> dict:
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, "host-launch-check"], capture_output=True, text=True, env=env,
                          timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"host-launch-check subprocess failed:\n{proc.stderr[-4000:]}")
    return {r["label"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def _skip_reason():
    import torch

    if torch.cuda.is_available():
        return "the host-only driver is for machines without a GPU (the GPU tests launch for real)"
    return nvidia_backend_reason()


@pytest.mark.parametrize("label", CASES)
def test_fast_launch_makes_the_same_launcher_call(label):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    r = _results()[label]
    assert r["launches"] >= 1, r
    assert not r["diffs"], f"{label}: the fast path's launch differs from Triton's: {r['diffs']}"
    # every case has tensor arguments: a cache hit passes them as addresses (no cuPointerGetAttribute)
    assert r["addresses"] >= r["launches"], f"{label}: the cache hit passed no tensor as an address: {r}"


def test_fast_launch_calls_the_launch_hooks_with_metadata():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    assert _results()["hook"]["seen"] == ["_combine_topk_fwd_kernel"] * 2


def test_fast_launch_caches_one_kernel_per_specialization():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # aligned and misaligned y: two specializations of the combine kernel, each compiled once
    assert _results()["cache"]["combine_variants"] == 2


def test_env_flag_reads_0_1_and_refuses_the_rest(monkeypatch):
    """The on/off switches (TITAN_MEGAMOE_FAST_LAUNCH, _PERSISTENT_GEMM2, _EAGER_AUTOGRAD): unset -> the
    default, "1" / "0" -> on / off, anything else ("true", "off", "") -> a ValueError naming the variable."""
    from titan_megamoe.kernels.jit import env_flag

    monkeypatch.delenv("TITAN_MEGAMOE_TEST_FLAG", raising=False)
    assert env_flag("TITAN_MEGAMOE_TEST_FLAG", True) is True and env_flag("TITAN_MEGAMOE_TEST_FLAG", False) is False
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv("TITAN_MEGAMOE_TEST_FLAG", value)
        assert env_flag("TITAN_MEGAMOE_TEST_FLAG", not want) is want
    for bad in ("true", "off", ""):
        monkeypatch.setenv("TITAN_MEGAMOE_TEST_FLAG", bad)
        with pytest.raises(ValueError, match="TITAN_MEGAMOE_TEST_FLAG=.*set it to 1 .on. or 0 .off."):
            env_flag("TITAN_MEGAMOE_TEST_FLAG", True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["host-launch-check"]:
        print(json.dumps(_check_all()))
    else:
        raise SystemExit("usage: python tests/test_launch.py host-launch-check")


def test_record_launches_names_each_kernel_with_its_config():
    """record_launches / kernel_configs (compare.layer's ``kernel_configs``): the routing layout and GEMM1 through
    the interpreter, recorded with their constexprs (by parameter name, positional or keyword), launch options and
    grids; tensors and runtime scalars left out; a second launch with the same config adds only its grid; nothing
    is recorded outside the context."""
    import os

    import torch

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.launch import kernel_configs, record_launches
    from titan_megamoe.kernels.routing import build_routing_layout_triton

    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("the interpreter path (CPU machines)")
    g = torch.Generator().manual_seed(0)
    T, K, E, D = 8, 2, 4, 64
    ids = torch.randint(0, E, (T, K), generator=g)
    y = torch.randn(T * K, D, generator=g).bfloat16()
    with record_launches() as launched:
        build_routing_layout_triton(ids, E, 16)
        gg.combine_topk(y, T, K)
        gg.combine_topk(y[: 4 * K], 4, K)
    gg.combine_topk(y, T, K)  # outside: not recorded
    names = [d["kernel"] for d in launched]
    assert names == ["_count_kernel", "_layout_kernel", "_combine_topk_fwd_kernel", "_combine_topk_fwd_kernel"], names
    cfg = kernel_configs(launched)
    (combine,) = cfg["_combine_topk_fwd_kernel"]  # one config, two grids
    assert combine["constexprs"] == {"K": K, "BLOCK_D": 64} and combine["options"] == {"num_warps": 1}
    assert combine["grids"] == [[T, 1], [4, 1]]
    layout = cfg["_layout_kernel"][0]
    assert layout["constexprs"]["BM"] == 16 and "ids_ptr" not in layout["constexprs"] and "P" not in layout["constexprs"]
    assert all(isinstance(v, (bool, int, float, str, type(None))) for c in cfg.values() for x in c
               for v in x["constexprs"].values())
