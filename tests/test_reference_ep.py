"""EP = 2 and EP = 4 in gloo processes equal the single-process result (reference operator and
MegaMoE layer under TorchTitan's own expert-parallel sharding)."""

from __future__ import annotations

import copy

import pytest
import torch

from titan_megamoe.testing import TOLERANCES, assert_close_rel, make_routing, run_gloo

pytestmark = pytest.mark.slow


def _global_inputs(T, D, F, E, K, R, routing, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(R * T, D, generator=gen)
    s = torch.rand(R * T, K, generator=gen)
    w1 = torch.randn(E, F, D, generator=gen) / D**0.5
    w3 = torch.randn(E, F, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, F, generator=gen) / F**0.5
    g = torch.randn(R * T, D, generator=gen)
    ids = make_routing(routing, R * T, E, K, ep=R, seed=seed)
    return x, ids, s, w1, w2, w3, g


def _op_worker(rank, R, T, D, F, E, K, routing, score_before, empty_rank):
    import torch.distributed as dist

    from titan_megamoe.ops.reference import mega_moe_ref

    x, ids, s, w1, w2, w3, g = _global_inputs(T, D, F, E, K, R, routing, seed=7)
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
    ref = mega_moe_ref(leaves[0], ids, leaves[1], *leaves[2:], num_experts=E, score_before_experts=score_before)
    ref.backward(g)

    e = E // R
    tok = slice(rank * T, (rank + 1) * T)
    if empty_rank and rank == R - 1:
        tok = slice(rank * T, rank * T)  # this rank has no tokens at all
    ex = slice(rank * e, (rank + 1) * e)
    mine = [t.detach()[sl].clone().requires_grad_() for t, sl in
            zip((x, s, w1, w2, w3), (tok, tok, ex, ex, ex))]
    out = mega_moe_ref(mine[0], ids[tok], mine[1], *mine[2:], num_experts=E, ep_group=dist.group.WORLD,
                       score_before_experts=score_before)
    out.backward(g[tok])
    if empty_rank:
        # the reference result for comparison leaves the empty rank's tokens out as well
        keep = torch.ones(R * T, dtype=torch.bool)
        keep[(R - 1) * T:] = False
        leaves2 = [t.detach().clone().requires_grad_() for t in (x[keep], s[keep], w1, w2, w3)]
        ref = mega_moe_ref(leaves2[0], ids[keep], leaves2[1], *leaves2[2:], num_experts=E,
                           score_before_experts=score_before)
        ref.backward(g[keep])
        full_x, full_s = torch.zeros_like(x), torch.zeros_like(s)
        full_x[keep], full_s[keep] = leaves2[0].grad, leaves2[1].grad
        expect = dict(out=torch.zeros_like(x), dx=full_x, ds=full_s, dw1=leaves2[2].grad,
                      dw2=leaves2[3].grad, dw3=leaves2[4].grad)
        expect["out"][keep] = ref.detach()
    else:
        expect = dict(out=ref.detach(), dx=leaves[0].grad, ds=leaves[1].grad,
                      dw1=leaves[2].grad, dw2=leaves[3].grad, dw3=leaves[4].grad)
    assert_close_rel(out, expect["out"][tok], torch.float32, "out")
    assert_close_rel(mine[0].grad, expect["dx"][tok], torch.float32, "dx")
    assert_close_rel(mine[1].grad, expect["ds"][tok], torch.float32, "dscores")
    for i, n in ((2, "dw1"), (3, "dw2"), (4, "dw3")):
        assert_close_rel(mine[i].grad, expect[n][ex], torch.float32, n)


EP_CASES = [
    # (R, T, D, F, E, K, routing, score_before_experts, empty_rank): the edge each row covers
    (2, 24, 16, 12, 8, 2, "uniform", False, False),
    (4, 19, 16, 12, 16, 4, "skewed", False, False),  # T not a multiple of anything, hot experts
    (2, 16, 16, 12, 8, 3, "one_rank", False, False),  # rank 1 computes nothing
    (4, 16, 16, 12, 8, 2, "empty_rank", False, False),  # nobody sends to the last rank
    (2, 16, 16, 12, 8, 1, "one_expert", True, False),  # top_k = 1, all on expert 0, score before
    (4, 20, 16, 12, 16, 3, "zero_expert", False, True),  # last rank has no tokens (T = 0)
    (2, 20, 11, 7, 4, 4, "uniform", False, False),  # odd dims, K = E: every rank gets every token
]


def _op_cases_worker(rank, R, cases):
    # one process group for all cases of this EP size: spawning costs ~10 s per launch
    for case in cases:
        try:
            _op_worker(rank, R, *case[1:])
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err


@pytest.mark.parametrize("R", [2, 4], ids=["EP2", "EP4"])
def test_reference_ep_matches_single_process(R):
    cases = [c for c in EP_CASES if c[0] == R]
    assert cases
    run_gloo(_op_cases_worker, R, cases)


def _layer_worker(rank, R, use_deepep):
    """MegaMoE under TorchTitan's apply_moe_ep_tp (ExpertParallel / DeepEPExpertParallel hooks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp
    from torchtitan.models.moe.moe import MoEArgs

    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE

    T, D, F, E, K = 24, 16, 12, 8, 2
    args = MoEArgs(num_experts=E, top_k=K, score_func="softmax", route_norm=True,
                   score_before_experts=False, num_shared_experts=0, use_grouped_mm=False)
    torch.manual_seed(0)
    single = MegaMoE(args, D, F, config=MegaMoEConfig(backend="reference"))
    with torch.no_grad():
        single.init_weights(0.02, torch.device("cpu"))
    ep_layer = copy.deepcopy(single)

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe, self.moe_enabled = moe, True

    class Model(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": Block(moe)})

    mesh = init_device_mesh("cpu", (R,), mesh_dim_names=("ep",))
    apply_moe_ep_tp(Model(ep_layer), tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None,
                    use_deepep=use_deepep)
    assert len(ep_layer.experts._forward_pre_hooks) >= 1, "TorchTitan's EP hooks should be installed"
    assert isinstance(ep_layer.experts.w1, DTensor) and ep_layer.experts.w1.placements == (Shard(0),)

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, R * T, D, generator=gen)
    g = torch.randn(1, R * T, D, generator=gen)
    xs = x.clone().requires_grad_()
    ref = single(xs)
    ref.backward(g)
    tok = slice(rank * T, (rank + 1) * T)
    xm = x[:, tok].clone().requires_grad_()
    out = ep_layer(xm)
    out.backward(g[:, tok])
    assert len(ep_layer.experts._forward_pre_hooks) == 0 and len(ep_layer.experts._forward_hooks) == 0
    assert_close_rel(out, ref[:, tok], torch.float32, "out")
    assert_close_rel(xm.grad, xs.grad[:, tok], torch.float32, "dx")
    e = E // R
    for n in ("w1", "w2", "w3"):
        got = getattr(ep_layer.experts, n).grad.to_local()
        assert_close_rel(got, getattr(single.experts, n).grad[rank * e:(rank + 1) * e], torch.float32, f"d{n}")
    # router gradients are per-rank partial sums of the single-process gradient
    import torch.distributed as dist

    gw = ep_layer.router.gate.weight.grad.clone()
    dist.all_reduce(gw)
    assert_close_rel(gw, single.router.gate.weight.grad, torch.float32, "dgate")


def _layer_both_worker(rank, R):
    for use_deepep in (False, True):
        try:
            _layer_worker(rank, R, use_deepep)
        except AssertionError as err:
            raise AssertionError(f"use_deepep={use_deepep}: {err}") from err


def test_layer_under_torchtitan_ep_plan():
    """ExpertParallel and DeepEPExpertParallel hooks are both stripped; results match EP = 1."""
    run_gloo(_layer_both_worker, 2)
