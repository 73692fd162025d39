"""torchrun worker (2+ GPUs): the expert-parallel Triton backend over symmetric memory against the
single-GPU reference on the same global inputs, forward and every gradient, on the edge cases; two
runs bitwise equal; repeated calls with changing routing (workspace reuse); then fwd+bwd timing of
the 30B shape (16384 tokens/rank) beside the reference EP path. The overlap modes: v1 (barriers
between dispatch, GEMMs and combine), v2 (x rows streamed into GEMM1 through per-block arrival
flags) and v3 (backward pushes under the wgrads), both bitwise equal to v1 on every case, in the CUDA
graph too. Blockwise FP8 ("fp8", "fp8_bwd",
ops/ep_fp8_backend.py) on the same cases: vs the fp32 reference within ``FP8_REL_BOUNDS``, out / dx /
d scores vs the EP = 1 FP8 op on all tokens within the bf16 tolerance (same per-row math, only the
sums' order differs), two runs bitwise equal (the second from the weight cache), a CUDA graph of
fwd+bwd, and timed beside bf16. "fp8" runs with both x payloads of its forward dispatch
(``ep_fp8_backend.FP8_DISPATCH``: "fp8" = e4m3 rows + scales quantized on the source, the default; "bf16"
= v1, quantized on the receiving rank): every output and gradient bitwise equal, and both timed
(``triton_ep_fp8`` / ``triton_ep_fp8_bf16dispatch``). ``EP_TRITON_PRECISIONS`` (default
"bf16,fp8,fp8_bwd") picks the precisions. Used by test_gpu.py; prints EP_TRITON PASS on success."""

import json
import os
import sys

import torch
import torch.distributed as dist

os.environ.setdefault("TRITON_INTERPRET", "0")

from titan_megamoe.ops import ep_fp8_backend  # noqa: E402
from titan_megamoe.ops.ep_library import CAPACITY, WAITS, mega_moe_ep_triton, mega_moe_ep_triton_fp8  # noqa: E402
from titan_megamoe.ops.fp8_backend import NONFINITE, Fp8WeightCache  # noqa: E402
from titan_megamoe.ops.reference import mega_moe_ref  # noqa: E402
from titan_megamoe.testing import FP8_REL_BOUNDS, TOLERANCES, assert_close_rel, make_routing, rel_err  # noqa: E402

NAMES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")
FP8 = ("fp8", "fp8_bwd")


def _case(routing, T, D, F, E, K, R, rank, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    x, s, g = mk(R * T, D).bfloat16(), torch.rand(R * T, K, generator=gen).cuda(), mk(R * T, D).bfloat16()
    w1, w3 = (mk(E, F, D).mul(D**-0.5).bfloat16() for _ in range(2))
    w2 = mk(E, D, F).mul(F**-0.5).bfloat16()
    ids = make_routing(routing, R * T, E, K, ep=R, seed=seed + 1).cuda()
    return x, s, g, w1, w2, w3, ids


def _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap="v1"):
    e_l = E // R
    sl = slice(rank * T, (rank + 1) * T)
    leaves = [t.clone().requires_grad_() for t in (x[sl], s[sl], w1[rank * e_l:(rank + 1) * e_l],
                                                   w2[rank * e_l:(rank + 1) * e_l], w3[rank * e_l:(rank + 1) * e_l])]
    out = mega_moe_ep_triton(leaves[0], ids[sl], leaves[1], *leaves[2:], ep_group=group, max_tokens_per_rank=t_cap,
                             recv_capacity=R * t_cap * K, layer_name="test", overlap=overlap)
    out.backward(g[sl])
    return [out.detach()] + [t.grad for t in leaves]


def _local_weights(w1, w2, w3, E, R, rank):
    """This rank's expert weights as persistent leaves (the FP8 weight cache keys on them)."""
    e_l = E // R
    return [w[rank * e_l:(rank + 1) * e_l].clone().requires_grad_() for w in (w1, w2, w3)]


def _run_ep_fp8(precision, x, s, g, wl, ids, T, K, R, rank, group, t_cap, cache):
    """FP8 EP op fwd + bwd on this rank's tokens with the weight leaves ``wl`` (their .grad reset)."""
    sl = slice(rank * T, (rank + 1) * T)
    for w in wl:
        w.grad = None
    leaves = [t.clone().requires_grad_() for t in (x[sl], s[sl])]
    out = mega_moe_ep_triton_fp8(leaves[0], ids[sl], leaves[1], *wl, fp8_forward=precision == "fp8", ep_group=group,
                                 max_tokens_per_rank=t_cap, recv_capacity=R * t_cap * K, cache=cache,
                                 layer_name="test")
    out.backward(g[sl])
    return [out.detach()] + [t.grad for t in leaves] + [w.grad for w in wl]


def _with_payload(payload, run):
    """``run()`` with the "fp8" forward's x payload set to ``payload`` ("fp8" / "bf16"), then restored."""
    old, ep_fp8_backend.FP8_DISPATCH = ep_fp8_backend.FP8_DISPATCH, payload
    try:
        return run()
    finally:
        ep_fp8_backend.FP8_DISPATCH = old


def _ep1_fp8(precision, x, s, g, w1, w2, w3, ids, T, rank):
    """The EP = 1 FP8 op on all ranks' tokens (all experts): this rank's out, dx, d scores."""
    from titan_megamoe.ops.library import mega_moe_triton_fp8

    leaves = [t.clone().requires_grad_() for t in (x, s)]
    out = mega_moe_triton_fp8(leaves[0], ids, leaves[1], w1, w2, w3, fp8_forward=precision == "fp8")
    out.backward(g)
    sl = slice(rank * T, (rank + 1) * T)
    return [out.detach()[sl], leaves[0].grad[sl], leaves[1].grad[sl]]


def _check_fp8(precision, got, again, want, ep1, cache):
    assert (cache.misses, cache.hits) == (3, 3), f"weight cache misses / hits {cache.misses} / {cache.hits}, want 3 / 3"
    bounds = FP8_REL_BOUNDS[precision]
    for i, (name, a, b, c) in enumerate(zip(NAMES, got, want, again)):
        assert torch.isfinite(a).all(), f"{name} not finite"
        assert torch.equal(a, c), f"{name}: two runs differ"
        if b.abs().max() == 0:  # experts of this rank got no row (or no token on this rank)
            assert i < 3 or (a == 0).all(), f"{name}: no rows, the gradient must be exactly 0"
            continue
        err = rel_err(a.float(), b.float())
        bound = bounds["out" if name == "out" else "grad"]
        assert err <= bound, f"{name}: relative error {err:.4f} vs the fp32 reference > {bound}"
        if i < 3:
            err1 = rel_err(a.float(), ep1[i].float())
            assert err1 <= TOLERANCES[torch.bfloat16], f"{name}: {err1:.2e} vs the EP = 1 fp8 op"


def main() -> int:
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    failures = []
    t_cap = 4096
    precisions = os.environ.get("EP_TRITON_PRECISIONS", "bf16,fp8,fp8_bwd").split(",")
    if torch.cuda.get_device_capability() < (8, 9):
        precisions = [p for p in precisions if p not in FP8]  # no FP8 tensor cores
    for routing, T, D, F, E, K in (("uniform", 4096, 2048, 768, 128, 8), ("skewed", 1000, 2048, 768, 128, 8),
                                   ("one_rank", 512, 2048, 768, 128, 2), ("empty_rank", 777, 2048, 768, 128, 1)):
        try:
            x, s, g, w1, w2, w3, ids = _case(routing, T, D, F, E, K, R, rank, seed=1)
            # clone: s is fp32 already, so s.float() is s itself and requires_grad_ would leak into later calls
            full = [t.detach().float().clone().requires_grad_() for t in (x, s, w1, w2, w3)]
            ref = mega_moe_ref(full[0], ids, full[1], *full[2:], num_experts=E)
            ref.backward(g.float())
            e_l, sl = E // R, slice(rank * T, (rank + 1) * T)
            want = [ref.detach()[sl], full[0].grad[sl], full[1].grad[sl]] + [
                w.grad[rank * e_l:(rank + 1) * e_l] for w in full[2:]]
        except Exception as e:  # noqa: BLE001
            failures.append(f"rank {rank} {routing} inputs / reference: {type(e).__name__}: {str(e)[:300]}")
            continue
        if "bf16" in precisions:
            try:
                got = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap)
                again = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap)
                v2 = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap="v2")
                v3 = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap="v3")
                for name, a, b, c, d, e3 in zip(NAMES, got, want, again, v2, v3):
                    assert torch.isfinite(a).all(), f"{name} not finite"
                    assert torch.equal(a, c), f"{name}: two runs differ"
                    assert torch.equal(a, d), f"{name}: overlap v2 differs from v1"
                    assert torch.equal(a, e3), f"{name}: overlap v3 (backward pushes under the wgrads) differs from v1"
                    if b.abs().max() > 0:
                        assert_close_rel(a.float(), b.float(), torch.bfloat16, name)
                CAPACITY.flush()
                WAITS.flush()
            except Exception as e:  # noqa: BLE001
                failures.append(f"rank {rank} {routing}: {type(e).__name__}: {str(e)[:300]}")
        for precision in (p for p in precisions if p in FP8):
            try:
                wl, cache = _local_weights(w1, w2, w3, E, R, rank), Fp8WeightCache()
                got = _run_ep_fp8(precision, x, s, g, wl, ids, T, K, R, rank, group, t_cap, cache)
                again = _run_ep_fp8(precision, x, s, g, wl, ids, T, K, R, rank, group, t_cap, cache)
                ep1 = _ep1_fp8(precision, x, s, g, w1, w2, w3, ids, T, rank)
                _check_fp8(precision, got, again, want, ep1, cache)
                if precision == "fp8":  # the v1 payload (bf16 rows, quantized on the receiving rank): same bits
                    v1 = _with_payload("bf16", lambda: _run_ep_fp8(precision, x, s, g, wl, ids, T, K, R, rank, group,
                                                                   t_cap, cache))
                    for name, a, b in zip(NAMES, got, v1):
                        assert torch.equal(a, b), f"{name}: FP8 dispatch payload differs from the bf16 payload"
                NONFINITE.flush()
                CAPACITY.flush()
                WAITS.flush()
            except Exception as e:  # noqa: BLE001
                failures.append(f"rank {rank} {routing} {precision}: {type(e).__name__}: {str(e)[:300]}")
    # CUDA graph: forward + backward of the EP op captured and replayed (proof of no host sync at EP > 1;
    # v2: its side-stream fork / join and the device-side epochs survive capture and replay)
    modes = (["v1", "v2", "v3"] if "bf16" in precisions else []) + [p for p in precisions if p in FP8]
    for overlap in modes:
        try:
            T, D, F, E, K = 2048, 2048, 768, 128, 8
            x, s, g, w1, w2, w3, ids = _case("uniform", T, D, F, E, K, R, rank, seed=9)
            if overlap in FP8:  # the weight leaves and their cache live across warm-up, capture and replays
                wl, cache = _local_weights(w1, w2, w3, E, R, rank), Fp8WeightCache()
                run = lambda: _run_ep_fp8(overlap, x, s, g, wl, ids, T, K, R, rank, group, t_cap, cache)  # noqa: E731
            else:
                run = lambda: _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap)  # noqa: E731
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    eager = [t.clone() for t in run()]
            torch.cuda.current_stream().wait_stream(side)
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = run()
            dist.barrier()
            for _ in range(2):  # twice: the second replay's flags must carry a new epoch
                graph.replay()
                torch.cuda.synchronize()
                for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), static, eager):
                    assert torch.equal(a, b), f"CUDA graph replay differs from eager in {name}"
            WAITS.flush()
        except Exception as e:  # noqa: BLE001
            failures.append(f"rank {rank} cuda graph {overlap}: {type(e).__name__}: {str(e)[:300]}")
    # timing, 30B shape, 16384 tokens per rank
    T, D, F, E, K = 16384, 2048, 768, 128, 8
    x, s, g, w1, w2, w3, ids = _case("uniform", T, D, F, E, K, R, rank, seed=5)
    times = {}
    fp8_w = {p: (_local_weights(w1, w2, w3, E, R, rank), Fp8WeightCache()) for p in precisions if p in FP8}
    names = (["triton_ep", "triton_ep_v2", "triton_ep_v3"] if "bf16" in precisions else []) + [
        f"triton_ep_{p}" for p in fp8_w] + (["triton_ep_fp8_bf16dispatch"] if "fp8" in fp8_w else [])
    for name in names + ["reference_ep"]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        samples = []
        iters = int(os.environ.get("EP_TRITON_ITERS", "13"))
        for it in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            ev[0].record()
            if name == "triton_ep_fp8_bf16dispatch":  # "fp8" with the v1 payload (bf16 rows over NVLink)
                _with_payload("bf16", lambda: _run_ep_fp8("fp8", x, s, g, fp8_w["fp8"][0], ids, T, K, R, rank, group,
                                                          T, fp8_w["fp8"][1]))
            elif name.startswith("triton_ep_fp8"):  # weights from the cache after the first call (once per step)
                p = name[len("triton_ep_"):]
                _run_ep_fp8(p, x, s, g, fp8_w[p][0], ids, T, K, R, rank, group, T, fp8_w[p][1])
            elif name.startswith("triton_ep"):
                _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, T,
                        name[-2:] if name[-3:] in ("_v2", "_v3") else "v1")
            else:
                e_l, sl = E // R, slice(rank * T, (rank + 1) * T)
                leaves = [t.clone().requires_grad_() for t in (x[sl], s[sl], w1[rank * e_l:(rank + 1) * e_l],
                          w2[rank * e_l:(rank + 1) * e_l], w3[rank * e_l:(rank + 1) * e_l])]
                mega_moe_ref(leaves[0], ids[sl], leaves[1], *leaves[2:], num_experts=E, ep_group=group).backward(g[sl])
            ev[1].record()
            torch.cuda.synchronize()
            if it >= min(3, iters - 1):
                samples.append(ev[0].elapsed_time(ev[1]))
        samples.sort()
        times[name] = samples[len(samples) // 2]
    if rank == 0:
        print("EP_TRITON_TIMES " + json.dumps({"fwd_bwd_ms_median": times, "T_per_rank": T, "R": R}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        print("\n".join(failures), flush=True)
        return 1
    print("EP_TRITON\nPASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
