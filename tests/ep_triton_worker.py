"""torchrun worker (2+ GPUs): the expert-parallel Triton backend over symmetric memory against the
single-GPU reference on the same global inputs, forward and every gradient, on the edge cases; two
runs bitwise equal; repeated calls with changing routing (workspace reuse); then fwd+bwd timing of
the 30B shape (16384 tokens/rank) beside the reference EP path. The overlap modes: v1 (barriers
between dispatch, GEMMs and combine) and v2 (x rows streamed into GEMM1 through per-block arrival
flags) and v3 (backward pushes under the wgrads), both bitwise equal to v1 on every case, in the CUDA
graph too. Used by test_gpu.py; prints
EP_TRITON PASS on success."""

import json
import os
import sys

import torch
import torch.distributed as dist

os.environ.setdefault("TRITON_INTERPRET", "0")

from titan_megamoe.ops.ep_library import CAPACITY, WAITS, mega_moe_ep_triton  # noqa: E402
from titan_megamoe.ops.reference import mega_moe_ref  # noqa: E402
from titan_megamoe.testing import assert_close_rel, make_routing  # noqa: E402


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


def main() -> int:
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    failures = []
    t_cap = 4096
    for routing, T, D, F, E, K in (("uniform", 4096, 2048, 768, 128, 8), ("skewed", 1000, 2048, 768, 128, 8),
                                   ("one_rank", 512, 2048, 768, 128, 2), ("empty_rank", 777, 2048, 768, 128, 1)):
        try:
            x, s, g, w1, w2, w3, ids = _case(routing, T, D, F, E, K, R, rank, seed=1)
            got = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap)
            again = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap)
            # clone: s is fp32 already, so s.float() is s itself and requires_grad_ would leak into later calls
            full = [t.detach().float().clone().requires_grad_() for t in (x, s, w1, w2, w3)]
            ref = mega_moe_ref(full[0], ids, full[1], *full[2:], num_experts=E)
            ref.backward(g.float())
            e_l, sl = E // R, slice(rank * T, (rank + 1) * T)
            want = [ref.detach()[sl], full[0].grad[sl], full[1].grad[sl]] + [
                w.grad[rank * e_l:(rank + 1) * e_l] for w in full[2:]]
            v2 = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap="v2")
            v3 = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap="v3")
            for name, a, b, c, d, e3 in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), got, want, again, v2, v3):
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
    # CUDA graph: forward + backward of the EP op captured and replayed (proof of no host sync at EP > 1;
    # v2: its side-stream fork / join and the device-side epochs survive capture and replay)
    for overlap in ("v1", "v2", "v3"):
        try:
            T, D, F, E, K = 2048, 2048, 768, 128, 8
            x, s, g, w1, w2, w3, ids = _case("uniform", T, D, F, E, K, R, rank, seed=9)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    eager = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap)
            torch.cuda.current_stream().wait_stream(side)
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = _run_ep(x, s, g, w1, w2, w3, ids, T, E, K, R, rank, group, t_cap, overlap)
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
    for name in ("triton_ep", "triton_ep_v2", "triton_ep_v3", "reference_ep"):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        samples = []
        iters = int(os.environ.get("EP_TRITON_ITERS", "13"))
        for it in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            ev[0].record()
            if name.startswith("triton_ep"):
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
