"""The megamoe converter on TorchTitan's MoE models: meta build -> convert -> materialize ->
forward/backward equal to stock TorchTitan; checkpoints interchangeable; AC and compile; refusals."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

import titan_megamoe  # noqa: F401  registers the converter
from titan_megamoe.config import MegaMoEConfigError
from titan_megamoe.converter import MegaMoEConverter
from titan_megamoe.errors import UnsupportedModelError
from titan_megamoe.layer import MegaMoE
from titan_megamoe.testing import assert_close_rel, stock_histc_on_cpu

SEQ = 32


def job_config(*extra: str):
    """A parsed job config with megamoe on the reference backend (these tests check the conversion against stock
    TorchTitan on CPU; the fused kernels' own tests are elsewhere); ``extra`` overrides."""
    return ConfigManager().parse_args([
        "--job.custom_config_module", "titan_megamoe.config",
        "--model.converters", "megamoe", "--megamoe.backend", "reference",
        "--training.local_batch_size", "2", "--training.seq_len", str(SEQ), *extra,
    ])


def dims(tp=1, ep=1, etp=1, pp=1):
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=pp, ep=ep, etp=etp, world_size=tp * pp * max(ep // tp, 1))


def build(name: str, flavor: str, *, convert: bool, n_layers: int = 2, seed: int = 0, **arg_overrides):
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(job_config())
    args.n_layers = n_layers
    args.max_seq_len = SEQ
    args.moe_args.use_grouped_mm = False  # stock grouped-mm path needs a GPU Triton kernel
    for k, v in arg_overrides.items():
        setattr(args, k, v)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if convert:
        MegaMoEConverter(job_config(), dims()).convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model, args


def loss_and_grads(model, vocab, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (2, SEQ), generator=gen)
    model.zero_grad(set_to_none=True)
    with stock_histc_on_cpu():
        logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


MODELS = [
    # (train spec, flavor, layers): what it covers
    ("qwen3", "debugmodel_moe", 2),  # softmax, route_norm, scores after experts, no shared expert
    ("deepseek_v3", "debugmodel", 3),  # sigmoid, node-limited groups, shared experts, dense first layer
    ("llama4", "debugmodel", 4),  # top_k = 1, shared expert, scores before experts, interleaved MoE
]


@pytest.mark.parametrize("name,flavor,layers", MODELS, ids=[m[0] for m in MODELS])
def test_converted_model_matches_stock(name, flavor, layers):
    stock, args = build(name, flavor, convert=False, n_layers=layers)
    mega, _ = build(name, flavor, convert=True, n_layers=layers)
    n_moe = sum(isinstance(m, MegaMoE) for m in mega.modules())
    assert n_moe >= 1 and not any(isinstance(m, MegaMoE) for m in stock.modules())
    # identical FQNs, shapes and init values (same RNG order as stock)
    sd_s, sd_m = stock.state_dict(), mega.state_dict()
    assert list(sd_s) == list(sd_m)
    for k in sd_s:
        assert torch.equal(sd_s[k], sd_m[k]), k
    loss_s, g_s = loss_and_grads(stock, args.vocab_size)
    loss_m, g_m = loss_and_grads(mega, args.vocab_size)
    assert torch.isfinite(loss_m) and abs(loss_m.item() - loss_s.item()) < 1e-5 * abs(loss_s.item())
    assert set(g_s) == set(g_m)
    for k in g_s:
        if g_s[k].abs().max() < 1e-8:  # mathematically zero gradients (e.g. top-1 normalized gate)
            assert g_m[k].abs().max() < 1e-6, k
            continue
        assert_close_rel(g_m[k], g_s[k], torch.float32, k)


def test_checkpoints_interchangeable_both_ways():
    stock, args = build("qwen3", "debugmodel_moe", convert=False, seed=3)
    mega, _ = build("qwen3", "debugmodel_moe", convert=True, seed=4)  # different init
    loss_before, _ = loss_and_grads(mega, args.vocab_size)
    mega.load_state_dict(stock.state_dict(), strict=True)  # stock -> megamoe
    loss_s, _ = loss_and_grads(stock, args.vocab_size)
    loss_m, _ = loss_and_grads(mega, args.vocab_size)
    assert abs(loss_before.item() - loss_s.item()) > 1e-4  # the load changed something
    assert abs(loss_m.item() - loss_s.item()) < 1e-5 * loss_s.item()
    stock2, _ = build("qwen3", "debugmodel_moe", convert=False, seed=5)
    stock2.load_state_dict(mega.state_dict(), strict=True)  # megamoe -> stock
    loss_s2, _ = loss_and_grads(stock2, args.vocab_size)
    assert abs(loss_s2.item() - loss_s.item()) < 1e-5 * loss_s.item()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_checkpointing_and_compile(mode):
    from torchtitan.models.llama4.infra.parallelize import apply_compile
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list
    from torchtitan.distributed.activation_checkpoint import apply_ac

    ref, args = build("qwen3", "debugmodel_moe", convert=True)
    loss_ref, g_ref = loss_and_grads(ref, args.vocab_size)
    model, _ = build("qwen3", "debugmodel_moe", convert=True)
    jc = job_config("--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", "op",
                    "--compile.enable", "--compile.backend", "aot_eager")
    if mode != "none":
        apply_ac(model, jc.activation_checkpoint, model_compile_enabled=True, op_sac_save_list=_op_sac_save_list)
    apply_compile(model, jc.compile, ep_enabled=False)
    for _ in range(2):  # second step: AC recompute + compiled graphs reused
        loss, grads = loss_and_grads(model, args.vocab_size)
    assert abs(loss.item() - loss_ref.item()) < 1e-5 * loss_ref.item()
    grads = {k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): v for k, v in grads.items()}
    assert set(grads) == set(g_ref)
    for k in g_ref:
        assert_close_rel(grads[k], g_ref[k], torch.float32, k)


def test_refuses_unsupported_parallelism():
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_degree=2"):
        MegaMoEConverter(job_config(), dims(tp=2))
    with pytest.raises(UnsupportedModelError, match="expert_tensor_parallel_degree=2"):
        MegaMoEConverter(job_config(), SimpleNamespace(tp=1, etp=2, pp=1, cp=1, ep=2))
    with pytest.raises(UnsupportedModelError, match="pipeline_parallel_degree=2"):
        MegaMoEConverter(job_config(), SimpleNamespace(tp=1, etp=1, pp=2, cp=1, ep=1))


def test_refuses_grouped_mm_quantization_and_unbuilt_backend():
    jc = job_config()
    jc.model.converters = ["quantize.grouped_mm.float8", "megamoe"]
    with pytest.raises(UnsupportedModelError, match="grouped_mm"):
        MegaMoEConverter(jc, dims())
    MegaMoEConverter(job_config("--megamoe.backend", "triton", "--megamoe.precision", "fp8_bwd"), dims())  # EP = 1
    # FP8 at EP > 1: expert parallelism inside the fused operator too (ops/ep_fp8_backend.py)
    for precision in ("fp8", "fp8_bwd"):
        MegaMoEConverter(job_config("--megamoe.backend", "triton", "--megamoe.precision", precision),
                         SimpleNamespace(tp=1, etp=1, pp=1, cp=1, ep=2))
    # bf16 triton at EP > 1: expert parallelism inside the fused operator, accepted without any flag
    MegaMoEConverter(job_config("--megamoe.backend", "triton"), SimpleNamespace(tp=1, etp=1, pp=1, cp=1, ep=2))
    MegaMoEConverter(job_config("--megamoe.backend", "triton"), dims())  # EP = 1: accepted
    with pytest.raises(NotImplementedError, match="not available yet.*reference/bf16, triton/bf16, triton/fp8"):
        MegaMoEConverter(job_config("--megamoe.precision", "fp8"), dims())  # the reference has no FP8


def _meta_model(name: str, flavor: str, n_layers: int | None = None):
    """A TorchTitan model of ``name`` / ``flavor`` on the meta device (nothing allocated)."""
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    if n_layers is not None:
        args.n_layers = n_layers
    with torch.device("meta"):
        return spec.model_cls(args)


def test_refuses_gpt_oss_experts_naming_the_layer():
    model = _meta_model("gpt_oss", "debugmodel", 2)
    with pytest.raises(UnsupportedModelError, match=r"layer 'layers\.0\.moe'.*GptOssGroupedExperts"):
        MegaMoEConverter(job_config(), dims()).convert(model)


def test_triton_refuses_score_before_experts_naming_the_layer():
    """Llama4 scales the experts' input by the score: the fused kernels cannot, so the converter refuses
    it on the meta model (before any allocation) and names the fix; the reference backend converts it."""
    model = _meta_model("llama4", "debugmodel", 2)
    with pytest.raises(UnsupportedModelError, match=r"layer 'layers\.\d+\.moe'.*score_before_experts.*reference"):
        MegaMoEConverter(job_config("--megamoe.backend", "triton"), dims()).convert(model)
    MegaMoEConverter(job_config("--megamoe.backend", "reference"), dims()).convert(model)
    assert any(isinstance(m, MegaMoE) for m in model.modules())


def test_refuses_dense_model():
    model = _meta_model("qwen3", "debugmodel")
    with pytest.raises(UnsupportedModelError, match="no TorchTitan MoE layer"):
        MegaMoEConverter(job_config(), dims()).convert(model)


def test_max_tokens_per_rank_defaults_to_batch_times_seq_and_is_enforced():
    conv = MegaMoEConverter(job_config(), dims())
    assert conv.max_tokens_per_rank == 2 * SEQ
    conv = MegaMoEConverter(job_config("--megamoe.max_tokens_per_rank", "16"), dims())
    assert conv.max_tokens_per_rank == 16
    spec = get_train_spec("qwen3")
    args = copy.deepcopy(spec.model_args["debugmodel_moe"])
    args.n_layers = 1
    with torch.device("meta"):
        model = spec.model_cls(args)
    conv.convert(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    from titan_megamoe.errors import CapacityError

    with pytest.raises(CapacityError, match=r"layers\.0\.moe: 64 tokens.*max_tokens_per_rank=16"):
        model(torch.randint(0, 100, (2, SEQ)))


def test_converts_deepep_layers(monkeypatch):
    """expert_parallel_comm_backend = "deepep" builds DeepEPMoE layers; megamoe takes their place.

    TorchTitan imports DeepEP when it builds those layers, so this CPU test stands in a stub for
    torchtitan.distributed.deepep (the hook stripping of DeepEPExpertParallel is tested in
    test_reference_ep.py)."""
    import sys
    import types

    stub = types.ModuleType("torchtitan.distributed.deepep")
    stub.sync_combine = lambda: None
    monkeypatch.setitem(sys.modules, "torchtitan.distributed.deepep", stub)
    monkeypatch.delitem(sys.modules, "torchtitan.models.moe.moe_deepep", raising=False)
    from torchtitan.models.moe.moe_deepep import DeepEPMoE

    stock, args = build("deepseek_v3", "debugmodel", convert=False, n_layers=3)
    spec = get_train_spec("deepseek_v3")
    dargs = copy.deepcopy(args)
    dargs.moe_impl = "deepep"
    with torch.device("meta"):
        model = spec.model_cls(dargs)
    assert any(isinstance(m, DeepEPMoE) for m in model.modules())
    MegaMoEConverter(job_config(), dims()).convert(model)
    assert not any(isinstance(m, DeepEPMoE) for m in model.modules())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.load_state_dict(stock.state_dict(), strict=True)
    loss_s, _ = loss_and_grads(stock, args.vocab_size)
    loss_m, _ = loss_and_grads(model, args.vocab_size)
    assert abs(loss_m.item() - loss_s.item()) < 1e-5 * loss_s.item()


def test_triton_backend_registers_its_op_for_selective_ac():
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    spec = get_train_spec("qwen3")
    args = copy.deepcopy(spec.model_args["debugmodel_moe"])
    args.n_layers = 1
    with torch.device("meta"):
        model = spec.model_cls(args)
    MegaMoEConverter(job_config("--megamoe.backend", "triton"), dims()).convert(model)
    assert torch.ops.megamoe.bf16_mega_moe_fwd.default in _op_sac_save_list
    assert torch.ops.megamoe.bf16_mega_moe_ep_fwd.default in _op_sac_save_list
    assert torch.ops.megamoe.fp8_mega_moe_ep_fwd.default in _op_sac_save_list
    assert model.layers["0"].moe.experts.config.backend == "triton"


def test_fp8_refuses_dims_not_multiple_of_128_naming_the_layer():
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.converter import check_fp8_dims

    args = MoEArgs(num_experts=4, top_k=2, score_func="softmax", route_norm=True, num_shared_experts=0)
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([MoE(args, dim=128, hidden_dim=96)])})
    check_fp8_dims(model, MegaMoEConfig(backend="triton", precision="bf16"))  # bf16: any dims
    with pytest.raises(MegaMoEConfigError, match=r"layers\.0.*precision = 'fp8'.*moe hidden dim=96.*'bf16'"):
        check_fp8_dims(model, MegaMoEConfig(backend="triton", precision="fp8"))


def test_reference_backend_is_named_slow_at_conversion(caplog):
    """The reference backend is the oracle: the converter says so (and what to set), the fused backend is quiet."""
    with caplog.at_level("WARNING"):
        MegaMoEConverter(job_config(), dims())
    assert 'backend "reference" is the pure-PyTorch oracle' in caplog.text
    assert 'set [megamoe] backend = "triton"' in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        MegaMoEConverter(job_config("--megamoe.backend", "triton"), dims())
    assert "oracle" not in caplog.text
