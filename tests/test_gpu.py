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


@pytest.mark.multigpu
def test_reference_ep2_nccl_matches_single_gpu():
    worker = Path(__file__).with_name("ep_check_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worker.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker)], env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and "EP_CHECK\nPASS" in proc.stdout, tail
