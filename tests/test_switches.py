"""titan_megamoe/switches.py: parsing, and override() putting a switch in force (environment, the
attributes read at import, the config caches) and restoring it, also after an error."""

import os

import pytest
import torch

from titan_megamoe import switches
from titan_megamoe.kernels import configs, launch
from titan_megamoe.ops import eager


def test_parse():
    assert switches.parse_switches("FUSED_ROUTER=0, TITAN_MEGAMOE_PERSISTENT_GEMM2=0") == {
        "TITAN_MEGAMOE_FUSED_ROUTER": "0", "TITAN_MEGAMOE_PERSISTENT_GEMM2": "0"}
    assert switches.parse_switches("WGRAD=triton") == {"TITAN_MEGAMOE_WGRAD": "triton"}
    assert switches.parse_switches("") == {}
    for bad, words in (("COMBINE_DTYPE=fp32", "separate processes"), ("FUSED_ROUTER=yes", "0, 1"),
                       ("FUSED_ROUTER", "NAME=VALUE"), ("FUSED_ROUTER=0,FUSED_ROUTER=1", "twice")):
        with pytest.raises(ValueError, match=words):
            switches.parse_switches(bad)
    assert switches.label({"TITAN_MEGAMOE_FUSED_ROUTER": "0", "TITAN_MEGAMOE_WGRAD": "triton"}) == \
        "FUSED_ROUTER=0,WGRAD=triton"


def test_every_switch_names_real_attributes_and_caches():
    import importlib

    for sw in switches.SWITCHES.values():
        assert sw.default in sw.values
        for mod, attr in sw.attrs:
            value = getattr(importlib.import_module(mod), attr)
            if sw.values == ("0", "1"):
                assert isinstance(value, bool), (sw.env, mod, attr)
            else:  # a multi-valued switch holds its string
                assert value in sw.values, (sw.env, mod, attr, value)
        for mod, fn in sw.caches:
            assert hasattr(getattr(importlib.import_module(mod), fn), "cache_clear"), (sw.env, mod, fn)


def test_override_sets_and_restores(monkeypatch):
    monkeypatch.delenv("TITAN_MEGAMOE_PERSISTENT_GEMM2", raising=False)
    monkeypatch.setenv("TITAN_MEGAMOE_FAST_LAUNCH", "1")
    was = (configs.PERSISTENT_GEMM2, eager.ENABLED, launch.FAST_LAUNCH)
    assert was == (True, True, True)  # the defaults
    assert configs.config_for("gemm2", 2048, 768, False).persistent  # cached with the default
    s = {"TITAN_MEGAMOE_PERSISTENT_GEMM2": "0", "TITAN_MEGAMOE_EAGER_AUTOGRAD": "0", "TITAN_MEGAMOE_FAST_LAUNCH": "0"}
    with switches.override(s):
        assert (configs.PERSISTENT_GEMM2, eager.ENABLED, launch.FAST_LAUNCH) == (False, False, False)
        assert not configs.config_for("gemm2", 2048, 768, False).persistent  # the cache was cleared
        assert os.environ["TITAN_MEGAMOE_PERSISTENT_GEMM2"] == "0"
    assert (configs.PERSISTENT_GEMM2, eager.ENABLED, launch.FAST_LAUNCH) == was
    assert configs.config_for("gemm2", 2048, 768, False).persistent
    assert "TITAN_MEGAMOE_PERSISTENT_GEMM2" not in os.environ and os.environ["TITAN_MEGAMOE_FAST_LAUNCH"] == "1"
    with pytest.raises(RuntimeError, match="inside"):
        with switches.override({"TITAN_MEGAMOE_EAGER_AUTOGRAD": "0"}):
            raise RuntimeError("inside")
    assert eager.ENABLED
    with pytest.raises(ValueError, match="not a known switch"):
        with switches.override({"TITAN_MEGAMOE_COMBINE_DTYPE": "fp32"}):
            pass


def test_fp8_gemm2_switch_reaches_the_fp8_config():
    from titan_megamoe.kernels import grouped_gemm_fp8 as g8

    assert g8.fp8_config_for("gemm2", 2048, 768, False).persistent
    with switches.override({"TITAN_MEGAMOE_PERSISTENT_GEMM2_FP8": "0"}):
        assert not g8.fp8_config_for("gemm2", 2048, 768, False).persistent
    assert g8.fp8_config_for("gemm2", 2048, 768, False).persistent


def test_gemm2_dgrad_wide_and_2cta_switches_reach_the_backward_config():
    from titan_megamoe.kernels._bwd_common import _default_bwd_config

    wide = _default_bwd_config("gemm2_dgrad", 128, 2048, 768, False)
    # the default: 128 x 256 tiles at 16 warps, one program per SM, 128 registers, 4 stages
    assert (wide.block_n, wide.num_warps, wide.num_stages, wide.maxnreg) == (256, 16, 4, 128)
    assert _default_bwd_config("gemm2_dgrad", 16, 64, 32, True).maxnreg is None  # interpreter: unchanged
    assert _default_bwd_config("gemm2_dgrad", 128, 256, 768, False).maxnreg is None  # small dims: unmeasured
    assert _default_bwd_config("gemm2_dgrad", 128, 2048, 128, False).block_n == 128  # F < 256: not wide
    assert _default_bwd_config("gemm2_dgrad", 128, 2048, 640, False).block_n == 128  # F % 256 != 0: unmeasured
    with switches.override({"TITAN_MEGAMOE_GEMM2_DGRAD_WIDE": "0"}):
        two = _default_bwd_config("gemm2_dgrad", 128, 2048, 768, False)
        assert (two.block_n, two.maxnreg, two.num_stages, two.num_warps) == (128, 128, 3, 8)  # two programs per SM
        with switches.override({"TITAN_MEGAMOE_GEMM2_DGRAD_2CTA": "0"}):
            one = _default_bwd_config("gemm2_dgrad", 128, 2048, 768, False)
            assert one.maxnreg is None and one.num_stages == 4  # one program per SM
            assert (two.block_m, two.block_n, two.block_k, two.use_tma) == (one.block_m, one.block_n, one.block_k,
                                                                              True)
    assert _default_bwd_config("gemm2_dgrad", 128, 2048, 768, False) == wide


def test_ws_wgrad_split_switch_picks_the_gluon_wgrad_config():
    """``WS_WGRAD_SPLIT`` "auto" (default) splits the Gluon wgrads' accumulators from D = 4096 (235B, measured faster)
    and not at 2048 (30B, measured slower); "1" / "0" force it; restored after."""
    from titan_megamoe.kernels import grouped_gemm_wgrad as W
    from titan_megamoe.kernels.ws_wgrad import SPLIT_CONFIG, WGRAD_CONFIG

    assert W.WS_WGRAD_SPLIT == "auto"
    assert W._ws_wgrad_config(4096) is SPLIT_CONFIG and W._ws_wgrad_config(2048) is WGRAD_CONFIG
    with switches.override({"TITAN_MEGAMOE_WS_WGRAD_SPLIT": "1"}):
        assert W._ws_wgrad_config(2048) is SPLIT_CONFIG
    with switches.override({"TITAN_MEGAMOE_WS_WGRAD_SPLIT": "0"}):
        assert W._ws_wgrad_config(4096) is WGRAD_CONFIG
    assert W._ws_wgrad_config(2048) is WGRAD_CONFIG and W.WS_WGRAD_SPLIT == "auto"


def test_fp8_gemm2_dgrad_2cta_switch_reaches_the_fp8_backward_config():
    """``GEMM2_DGRAD_FP8_2CTA`` picks the GPU config of the Triton FP8 GEMM2 dgrad: "auto" (default) takes BN 64 at 128
    registers (two programs per SM) at D = 2048, where it measured faster, and BN 128 at D = 4096, where it measured
    slower; "1" / "0" force one; the interpreter's config never changes; restored after."""
    from titan_megamoe.kernels import grouped_gemm_fp8_bwd as B8

    assert B8.GEMM2_DGRAD_FP8_2CTA == "auto"
    two = B8.fp8_bwd_config_for("gemm2_dgrad", 2048, 768, False)
    assert two == B8.HOPPER_GEMM2_DGRAD_FP8_2CTA and (two.block_n, two.maxnreg) == (64, 128)
    one = B8.fp8_bwd_config_for("gemm2_dgrad", 4096, 1536, False)
    assert (one.block_n, one.maxnreg) == (128, None)  # one program per SM
    interp = B8.fp8_bwd_config_for("gemm2_dgrad", 2048, 768, True)
    with switches.override({"TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA": "1"}):
        assert B8.fp8_bwd_config_for("gemm2_dgrad", 4096, 1536, False) == two
        assert B8.fp8_bwd_config_for("gemm2_dgrad", 2048, 768, True) == interp
    with switches.override({"TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA": "0"}):
        assert B8.fp8_bwd_config_for("gemm2_dgrad", 2048, 768, False).block_n == 128
    assert B8.fp8_bwd_config_for("gemm2_dgrad", 2048, 768, False) == two
    assert B8.fp8_bwd_config_for("gemm2_dgrad", 4096, 1536, False) == one


def test_override_sets_a_multi_valued_switch_as_its_string():
    from titan_megamoe.kernels import grouped_gemm_bwd

    assert grouped_gemm_bwd.WS_GEMM1_DGRAD == "coop"  # the default
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_DGRAD": "pingpong"}):
        assert grouped_gemm_bwd.WS_GEMM1_DGRAD == "pingpong"
    assert grouped_gemm_bwd.WS_GEMM1_DGRAD == "coop"


def test_override_restores_a_module_it_imported_first():
    """A switch whose module the process has not imported yet: after the override it holds the environment's value,
    not the overridden one (the module must be imported before the variable is set; sessions 20-21's compare.layer
    fp8 rows ran the Gluon wgrad after a bf16 row had flipped it, for want of that)."""
    import subprocess
    import sys

    default = switches.SWITCHES["TITAN_MEGAMOE_WS_WGRAD_FP8"].default == "1"
    flipped = "0" if default else "1"
    code = ("import sys\n"
            "from titan_megamoe import switches\n"
            "assert 'titan_megamoe.ops.fp8_backend' not in sys.modules\n"
            f"with switches.override({{'TITAN_MEGAMOE_WS_WGRAD_FP8': '{flipped}'}}):\n"
            "    from titan_megamoe.ops import fp8_backend as fb\n"
            f"    assert fb.WS_WGRAD_FP8 is {not default}\n"
            "print(fb.WS_WGRAD_FP8)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TITAN_MEGAMOE_WS_WGRAD_FP8"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(default), out.stdout


def test_skip_pad_blocks_switch_reaches_the_gluon_launches(monkeypatch):
    """``SKIP_PAD_BLOCKS`` (default off) turns the GEMM1 kernels' ``skip_empty`` and the wgrads' ``trim_k`` on
    and off at launch (the launcher is replaced by a recorder: no GPU, nothing compiled)."""
    from titan_megamoe.kernels import ws_gemm, ws_wgrad
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    if not ws_gemm.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper API")
    calls = []
    for mod in (ws_gemm, ws_wgrad):
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, *args, **kw: calls.append((kernel, args)))
    T, K, E, D, F = 64, 2, 4, 256, 256
    lay = build_routing_layout_torch(torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(0)), E, 128)
    bf = dict(dtype=torch.bfloat16)
    x, w = torch.randn(T, D).to(**bf), torch.randn(E, F, D).to(**bf)
    gu, h = torch.empty(lay.n_cap, 2 * F, **bf), torch.empty(lay.n_cap, F, **bf)

    def flags():
        calls.clear()
        ws_gemm.launch_gemm1_fwd(x, w, w, lay, gu, h, programs=4)
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, torch.empty(lay.n_cap, D, **bf), ws_gemm.CONFIGS["coop"], programs=4)
        ws_wgrad.ws_wgrad_w13(gu, x, lay, programs=4)
        ws_wgrad.ws_wgrad_w2(x, h, lay, programs=4)
        return [args[k.arg_names.index("SKIP_EMPTY")] if "SKIP_EMPTY" in k.arg_names else args[-1] for k, args in calls]

    monkeypatch.setattr(ws_wgrad, "_platform_reason", lambda t: None)  # the wgrads' checks, as on an sm_90 GPU
    assert flags() == [False, False, True, True]  # default: the wgrads' trim alone (WGRAD_TRIM_K)
    with switches.override({"TITAN_MEGAMOE_SKIP_PAD_BLOCKS": "1"}):
        assert ws_gemm.SKIP_PAD_BLOCKS is True and ws_wgrad.SKIP_PAD_BLOCKS is True
        assert flags() == [True] * 4
    assert ws_gemm.SKIP_PAD_BLOCKS is False and ws_wgrad.SKIP_PAD_BLOCKS is False
    with switches.override({"TITAN_MEGAMOE_WGRAD_TRIM_K": "0"}):  # every padded row reduced
        assert ws_wgrad.TRIM_K is False
        assert flags() == [False] * 4
    with switches.override({"TITAN_MEGAMOE_WGRAD_TRIM_K": "0", "TITAN_MEGAMOE_SKIP_PAD_BLOCKS": "1"}):
        assert flags() == [True] * 4  # SKIP_PAD_BLOCKS still trims the wgrads
    assert flags() == [False, False, True, True]


def _gemm1_launch_operands(T, K, E, D, F):
    """(layout, x, w, gate_up, h, dx) on the CPU for the GEMM1 launchers under a recording ``launch``."""
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    lay = build_routing_layout_torch(torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(0)), E, 128)
    bf = dict(dtype=torch.bfloat16)
    x, w = torch.randn(T, D).to(**bf), torch.randn(E, F, D).to(**bf)
    gu, h, dx = (torch.empty(lay.n_cap, c, **bf) for c in (2 * F, F, D))
    return lay, x, w, gu, h, dx


def test_ws_gemm1_grid_switch_sizes_the_cooperative_gemm1_grids(monkeypatch):
    """``WS_GEMM1_GRID`` (default off) launches the cooperative GEMM1 forward / dgrad with one program per tile;
    ping-pong keeps one per SM (its two consumers need two tiles), and an explicit ``programs`` always wins."""
    from titan_megamoe.kernels import ws_gemm

    if not ws_gemm.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper API")
    grids = []
    monkeypatch.setattr(ws_gemm, "launch", lambda kernel, grid, *args, **kw: grids.append(grid[0]))
    monkeypatch.setattr(ws_gemm, "_sm_count", lambda idx: 3)  # an SM count, as on a GPU with 3 SMs
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    T, K, E, D, F = 300, 2, 4, 512, 256
    lay, x, w, gu, h, dx = _gemm1_launch_operands(T, K, E, D, F)

    def sizes(**kw):
        grids.clear()
        ws_gemm.launch_gemm1_fwd(x, w, w, lay, gu, h, **kw)
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["coop"], **kw)
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["pingpong"], **kw)
        return grids[:]

    fwd_tiles = lay.n_tiles_cap * (F // ws_gemm.FWD_CONFIG.block_n)
    dgrad_tiles = lay.n_tiles_cap * (D // ws_gemm.CONFIGS["coop"].block_n)
    assert fwd_tiles > 3 and dgrad_tiles > 3
    assert sizes() == [3, 3, 3]
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_GRID": "1"}):
        assert sizes() == [fwd_tiles, dgrad_tiles, 3]
        assert sizes(programs=2) == [2, 2, 2]
    assert sizes() == [3, 3, 3]


def test_ws_gemm1_expert_order_switch_reaches_the_gemm1_launches(monkeypatch):
    """``WS_GEMM1_EXPERT_ORDER`` (default on since session 32) launches the bf16 GEMM1 forward and dgrad with
    ``GROUP_M`` 0 (the expert-major, column-by-column tile order); off, each config's own ``group_m``."""
    from titan_megamoe.kernels import ws_gemm

    if not ws_gemm.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper API")
    group_m = []
    monkeypatch.setattr(ws_gemm, "launch", lambda kernel, grid, *args, **kw: group_m.append(
        args[kernel.arg_names.index("GROUP_M")]))
    T, K, E, D, F = 64, 2, 4, 256, 256
    lay, x, w, gu, h, dx = _gemm1_launch_operands(T, K, E, D, F)

    def orders():
        group_m.clear()
        ws_gemm.launch_gemm1_fwd(x, w, w, lay, gu, h, programs=4)
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["pingpong"], programs=4)
        return group_m[:]

    assert orders() == [0, 0]
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_EXPERT_ORDER": "0"}):
        assert orders() == [ws_gemm.FWD_CONFIG.group_m, ws_gemm.CONFIGS["pingpong"].group_m] == [1, 8]
    assert orders() == [0, 0]


def test_ws_gemm1_dynamic_switch_reaches_the_cooperative_gemm1_launches(monkeypatch):
    """``WS_GEMM1_DYNAMIC`` (default off) launches the cooperative GEMM1 forward / dgrad with ``DYNAMIC`` and a
    zeroed int32 counter, on the persistent grid even with ``WS_GEMM1_GRID`` on; ping-pong stays static. While the
    schedule is fenced off (``ws_gemm.DYNAMIC_FENCED``: no gain measured) the cooperative launches raise, naming the
    switch; the ping-pong one still launches."""
    from titan_megamoe.kernels import ws_gemm

    if not ws_gemm.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper API")
    seen = []

    def record(kernel, grid, *args, **kw):
        counter = args[kernel.arg_names.index("counter_ptr")]
        seen.append((grid[0], args[kernel.arg_names.index("DYNAMIC")],
                     counter.dtype == torch.int32 and counter.numel() == 1 and int(counter) == 0))

    monkeypatch.setattr(ws_gemm, "launch", record)
    monkeypatch.setattr(ws_gemm, "_sm_count", lambda idx: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    T, K, E, D, F = 300, 2, 4, 512, 256
    lay, x, w, gu, h, dx = _gemm1_launch_operands(T, K, E, D, F)

    def launches():
        seen.clear()
        ws_gemm.launch_gemm1_fwd(x, w, w, lay, gu, h)
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["coop"])
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["pingpong"])
        return [(g, d) for g, d, _ in seen], [c for _, d, c in seen if d]

    assert launches() == ([(3, False)] * 3, [])
    assert ws_gemm.DYNAMIC_FENCED
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_DYNAMIC": "1"}):
        for coop in (lambda: ws_gemm.launch_gemm1_fwd(x, w, w, lay, gu, h),
                     lambda: ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["coop"])):
            with pytest.raises(RuntimeError, match="TITAN_MEGAMOE_WS_GEMM1_DYNAMIC.*hung"):
                coop()
        seen.clear()
        ws_gemm.launch_gemm1_dgrad(gu, w, w, lay, dx, ws_gemm.CONFIGS["pingpong"])
        assert [(g, d) for g, d, _ in seen] == [(3, False)]
    monkeypatch.setattr(ws_gemm, "DYNAMIC_FENCED", False)  # the kernel's own path, for debugging it on a GPU
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_DYNAMIC": "1"}):
        assert launches() == ([(3, True), (3, True), (3, False)], [True, True])
        with switches.override({"TITAN_MEGAMOE_WS_GEMM1_GRID": "1"}):  # the counter schedule keeps one per SM
            assert launches()[0] == [(3, True), (3, True), (3, False)]
    assert launches() == ([(3, False)] * 3, [])
