"""torchrun worker: the reference operator at EP = world size on GPUs (NCCL) equals the single-GPU
result on the same global inputs, forward and every gradient. Used by test_gpu.py."""

import os
import sys

import torch
import torch.distributed as dist

from titan_megamoe.ops.reference import mega_moe_ref
from titan_megamoe.testing import assert_close_rel, make_routing


def main() -> int:
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    failures = []
    for routing, T, D, F, E, K in (("uniform", 4096, 2048, 768, 128, 8), ("skewed", 1000, 512, 256, 32, 4),
                                   ("one_rank", 512, 256, 128, 16, 2), ("empty_rank", 777, 256, 128, 16, 3)):
        try:
            gen = torch.Generator(device="cpu").manual_seed(1)
            mk = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
            x, s, g = mk(R * T, D).bfloat16(), torch.rand(R * T, K, generator=gen).cuda(), mk(R * T, D).bfloat16()
            w1, w3 = (mk(E, F, D).mul(D**-0.5).bfloat16() for _ in range(2))
            w2 = mk(E, D, F).mul(F**-0.5).bfloat16()
            ids = make_routing(routing, R * T, E, K, ep=R, seed=2).cuda()
            full = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
            ref = mega_moe_ref(full[0], ids, full[1], *full[2:], num_experts=E)
            ref.backward(g)
            e, tok = E // R, slice(rank * T, (rank + 1) * T)
            ex = slice(rank * e, (rank + 1) * e)
            mine = [t[sl].clone().requires_grad_() for t, sl in zip((x, s, w1, w2, w3), (tok, tok, ex, ex, ex))]
            out = mega_moe_ref(mine[0], ids[tok], mine[1], *mine[2:], num_experts=E, ep_group=dist.group.WORLD)
            out.backward(g[tok])
            # same bf16 operands, different fp32 summation order -> fp32-level differences, then a bf16 cast
            assert_close_rel(out, ref[tok], torch.bfloat16, f"{routing} out")
            assert_close_rel(mine[0].grad, full[0].grad[tok], torch.bfloat16, f"{routing} dx")
            assert_close_rel(mine[1].grad, full[1].grad[tok], torch.float32, f"{routing} dscores")
            for i, n in ((2, "dw1"), (3, "dw2"), (4, "dw3")):
                assert_close_rel(mine[i].grad, full[i].grad[ex], torch.bfloat16, f"{routing} {n}")
            # bitwise determinism: the same call again gives the same bits
            out2 = mega_moe_ref(mine[0].detach(), ids[tok], mine[1].detach(), *[m.detach() for m in mine[2:]],
                                num_experts=E, ep_group=dist.group.WORLD)
            assert torch.equal(out2, out.detach()), f"{routing}: repeated call differs"
        except Exception as err:  # gathered below so no rank hangs
            failures.append(f"rank {rank}: {type(err).__name__}: {err}")
    allf = [None] * R
    dist.all_gather_object(allf, failures)
    dist.destroy_process_group()
    bad = [f for fs in allf for f in fs]
    if rank == 0:
        print("EP_CHECK", "PASS" if not bad else "FAIL", f"EP={R}", *bad, sep="\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
