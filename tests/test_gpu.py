"""GPU checks of the reference operator at real shapes (skipped on CPU machines, reason shown)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.models.moe.moe import MoEArgs

from titan_megamoe.testing import assert_close_rel, build_moe_pair


@pytest.mark.cuda
@pytest.mark.parametrize("dim,hidden,tokens", [(2048, 768, 8192), (4096, 1536, 2048)], ids=["30b-shape", "235b-shape"])
def test_layer_matches_stock_on_gpu(dim, hidden, tokens):
    """MegaMoE (reference) vs stock TorchTitan MoE with its real CUDA path (histc, grouped_mm)."""
    args = MoEArgs(num_experts=128, top_k=8, score_func="softmax", route_norm=True,
                   score_before_experts=False, num_shared_experts=0)
    pair = build_moe_pair(args, dim, hidden, dtype=torch.bfloat16, seed=0)
    stock, mega = pair.stock.cuda(), pair.mega.cuda()
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, tokens, dim, generator=gen).bfloat16().cuda()
    g = torch.randn(1, tokens, dim, generator=gen).bfloat16().cuda()
    res = []
    for layer in (stock, mega):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(g)
        res.append([out, xi.grad, layer.experts.w1.grad, layer.experts.w2.grad, layer.experts.w3.grad,
                    layer.router.gate.weight.grad])
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dw3", "dgate"), res[1], res[0]):
        assert_close_rel(a, b, torch.bfloat16, name)


def _ep_nproc() -> int:
    """GPUs (= EP size) of the multi-GPU tests: ``TITAN_MEGAMOE_TEST_EP`` (default 2; scripts/gpu_ep8.sh passes 8),
    skipped when fewer are visible. The workers take any EP size that divides their 128 experts."""
    n = int(os.environ.get("TITAN_MEGAMOE_TEST_EP", "2"))
    if torch.cuda.device_count() < n:
        pytest.skip(f"TITAN_MEGAMOE_TEST_EP={n} needs {n} CUDA GPUs (visible: {torch.cuda.device_count()})")
    return n


@pytest.mark.multigpu
def test_reference_ep2_nccl_matches_single_gpu():
    worker = Path(__file__).with_name("ep_check_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worker.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(_ep_nproc()), str(worker)], env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and "EP_CHECK\nPASS" in proc.stdout, tail


def _triton_inputs(T, D, F, E, K, seed=0):
    from titan_megamoe.testing import make_routing

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16().cuda()
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16().cuda()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16().cuda()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16().cuda()
    s = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    dout = torch.randn(T, D, generator=g).bfloat16().cuda()
    ids = make_routing("uniform", T, E, K, seed=seed).cuda()
    return x, ids, s, w1, w2, w3, dout


@pytest.mark.cuda
@pytest.mark.parametrize("dim,hidden,tokens", [(2048, 768, 16384), (4096, 1536, 4096)], ids=["30b-shape", "235b-shape"])
def test_triton_matches_reference_real_shapes(dim, hidden, tokens):
    from titan_megamoe.ops import mega_moe
    from titan_megamoe.ops.reference import mega_moe_ref

    x, ids, s, w1, w2, w3, dout = _triton_inputs(tokens, dim, hidden, 128, 8)
    res = []
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
        fn = mega_moe if backend == "triton" else mega_moe_ref
        kw = {"backend": "triton"} if backend == "triton" else {}
        out = fn(leaves[0], ids, leaves[1], *leaves[2:], num_experts=128, **kw)
        out.backward(dout)
        res.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), *res):
        assert torch.isfinite(a).all(), name
        assert_close_rel(a.float(), b.float(), torch.bfloat16, name)


@pytest.mark.cuda
def test_triton_fwd_bwd_captures_in_cuda_graph():
    """Proof of no host sync: forward + backward of the fused op replay from a CUDA graph and give the
    eager results bitwise."""
    from titan_megamoe.ops import mega_moe

    x, ids, s, w1, w2, w3, dout = _triton_inputs(4096, 2048, 768, 128, 8, seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]

    def step():
        for t in leaves:
            t.grad = None
        out = mega_moe(leaves[0], ids, leaves[1], *leaves[2:], num_experts=128, backend="triton")
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = step().detach().clone()
    torch.cuda.current_stream().wait_stream(side)
    eager_grads = [t.grad.clone() for t in leaves]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    for t, g in zip(leaves, eager_grads):
        assert torch.equal(t.grad, g)


@pytest.mark.cuda
def test_triton_layer_has_no_host_sync():
    """The whole MegaMoE layer (router, counts, fused experts), forward and backward, under CUDA's sync
    debug mode set to "error": any device-to-host read (e.g. torch.bincount) raises."""
    from compare.builders import build_layer
    from compare.shapes import parse_shape

    moe = build_layer("megamoe-triton", "bf16", parse_shape("custom:2048,768,128,8"), torch.device("cuda")).module
    x = torch.randn(1, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    moe(x).backward(g)  # first call: Triton compiles, allocator grows (may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).backward(g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


@pytest.mark.multigpu
def test_ep_triton_two_gpus():
    """The expert-parallel Triton backend over symmetric memory (2 GPUs): vs the reference on edge
    cases, bitwise repeatable, workspace reuse; see tests/ep_triton_worker.py."""
    worker = Path(__file__).with_name("ep_triton_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worker.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(_ep_nproc()), str(worker)], env=env, capture_output=True, text=True, timeout=600)
    # the worker prints its failures on stdout; stderr's tail is mostly torchrun's own traceback
    tail = proc.stdout[-5000:] + "\n--- stderr ---\n" + proc.stderr[-1500:]
    assert proc.returncode == 0 and "EP_TRITON\nPASS" in proc.stdout, tail


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_op_matches_reference_30b_shape(precision):
    """Blockwise FP8 fused op at the Qwen3-30B-A3B layer shape (D 2048, F 768, E 128, K 8, T 4096) vs
    the bf16 reference, within ``FP8_REL_BOUNDS`` (+ the bf16 tolerance: the reference is bf16 here);
    the second call hits the weight cache and gives the same bits; no non-finite scale reported."""
    from titan_megamoe.ops import mega_moe
    from titan_megamoe.ops.fp8_backend import NONFINITE, Fp8WeightCache
    from titan_megamoe.ops.reference import mega_moe_ref
    from titan_megamoe.testing import FP8_REL_BOUNDS, TOLERANCES, rel_err

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    x, ids, s, w1, w2, w3, dout = _triton_inputs(4096, 2048, 768, 128, 8)
    cache = Fp8WeightCache()
    weights = [t.clone().requires_grad_() for t in (w1, w2, w3)]  # the same parameters for both fp8 calls
    res = []
    for impl in (precision, precision, "reference"):
        for w in weights:
            w.grad = None
        ws = weights if impl != "reference" else [t.clone().requires_grad_() for t in (w1, w2, w3)]
        leaves = [x.clone().requires_grad_(), s.clone().requires_grad_(), *ws]
        if impl == "reference":
            out = mega_moe_ref(leaves[0], ids, leaves[1], *leaves[2:], num_experts=128)
        else:
            out = mega_moe(leaves[0], ids, leaves[1], *leaves[2:], num_experts=128, backend="triton",
                           precision=precision, fp8_cache=cache, layer_name="gpu.moe")
        out.backward(dout)
        res.append([out.detach()] + [t.grad for t in leaves])
    NONFINITE.flush()
    assert (cache.misses, cache.hits) == (3, 3)
    bounds = FP8_REL_BOUNDS[precision]
    for name, a, a2, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), *res):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, a2), f"{name}: not bitwise repeatable"
        bound = (bounds["out"] if name == "out" else bounds["grad"]) + TOLERANCES[torch.bfloat16]
        err = rel_err(a.float(), b.float())
        assert err <= bound, f"{precision} {name}: relative error {err:.4f} > {bound}"


@pytest.mark.cuda
def test_fused_fp8_bwd_layer_forward_is_the_bf16_layers():
    """The fused "fp8_bwd" node's forward runs the bf16 node's launches (ops/eager_layer_fp8.py): at the 30B layer
    shape its output and counts equal the bf16 layer's bitwise (same weights, gate inside the router), and its
    backward gives finite gradients with the FP8 weights it took from the cache after the forward."""
    from compare.builders import build_layer
    from compare.shapes import parse_shape

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    shape = parse_shape("custom:2048,768,128,8")
    bf16 = build_layer("megamoe-triton", "bf16", shape, torch.device("cuda")).module
    fp8b = build_layer("megamoe-triton", "fp8_bwd", shape, torch.device("cuda")).module
    fp8b.load_state_dict(bf16.state_dict())
    gen = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(1, 4096, 2048, generator=gen).bfloat16().cuda()
    outs = []
    for layer in (bf16, fp8b):
        layer.tokens_per_expert.zero_()
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), layer.tokens_per_expert.clone(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]), "fp8_bwd forward output differs from bf16's"
    assert torch.equal(outs[0][1], outs[1][1]), "tokens_per_expert"
    assert torch.isfinite(outs[1][2]).all() and outs[1][2].abs().sum() > 0
