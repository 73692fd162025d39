"""The environment switches that can be flipped inside one running process, for same-process A/B runs.

Why: on the H200 machines identical code differs by ~0.15 ms of device time from one process to the
next (docs/NOTES.md, session 8), larger than most single changes measure, so a switch is best compared
with itself in one process (``python -m compare.layer --switches FUSED_ROUTER=0``).

Each switch is an environment variable (docs/SWITCHES.md). Some are read on every call (then setting
the variable is enough); others are read once at import into a module attribute, and some of those
feed ``functools.lru_cache``d config functions: :func:`override` sets the variable, the attributes and
clears the caches, and restores all three on exit. Switches tied to state allocated once per process
(``TITAN_MEGAMOE_COMBINE_DTYPE`` sizes the EP workspace) or read deep inside the FP8 path
(``_FP8_DISPATCH``, ``_FP8_T_LD``) are not listed: compare those in separate processes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass

__all__ = ["Switch", "SWITCHES", "parse_switches", "override", "label"]

PREFIX = "TITAN_MEGAMOE_"


@dataclass(frozen=True)
class Switch:
    """One switch.

    Attributes:
        env: the environment variable.
        default: its value when unset.
        values: the values it takes.
        attrs: (module, attribute) pairs holding the value read at import (a bool for "0" / "1"
            switches, the string for the others); empty for a switch read on every call.
        caches: (module, function) pairs of ``lru_cache``d functions whose answers depend on it.
    """

    env: str
    default: str
    values: tuple[str, ...] = ("0", "1")
    attrs: tuple[tuple[str, str], ...] = ()
    caches: tuple[tuple[str, str], ...] = ()


_CONFIG_CACHES = (("titan_megamoe.kernels.configs", "config_for"),
                  ("titan_megamoe.kernels._bwd_common", "_default_bwd_config"))

SWITCHES: dict[str, Switch] = {s.env: s for s in (
    Switch("TITAN_MEGAMOE_FUSED_ROUTER", "1"),
    Switch("TITAN_MEGAMOE_WGRAD", "auto", values=("auto", "triton", "grouped_mm", "gluon")),
    Switch("TITAN_MEGAMOE_EAGER_AUTOGRAD", "1", attrs=(("titan_megamoe.ops.eager", "ENABLED"),)),
    Switch("TITAN_MEGAMOE_FAST_LAUNCH", "1", attrs=(("titan_megamoe.kernels.launch", "FAST_LAUNCH"),)),
    Switch("TITAN_MEGAMOE_POINTER_ARGS", "1", attrs=(("titan_megamoe.kernels.launch", "POINTER_ARGS"),)),
    Switch("TITAN_MEGAMOE_PERSISTENT_GEMM2", "1", attrs=(("titan_megamoe.kernels.configs", "PERSISTENT_GEMM2"),),
           caches=_CONFIG_CACHES),
    Switch("TITAN_MEGAMOE_GEMM2_DGRAD_2CTA", "1", attrs=(("titan_megamoe.kernels.configs", "GEMM2_DGRAD_2CTA"),),
           caches=_CONFIG_CACHES),
    Switch("TITAN_MEGAMOE_GEMM2_DGRAD_WIDE", "1", attrs=(("titan_megamoe.kernels.configs", "GEMM2_DGRAD_WIDE"),),
           caches=_CONFIG_CACHES),
    Switch("TITAN_MEGAMOE_SKIP_PAD_BLOCKS", "0", attrs=(("titan_megamoe.kernels.ws_gemm", "SKIP_PAD_BLOCKS"),
                                                         ("titan_megamoe.kernels.ws_wgrad", "SKIP_PAD_BLOCKS"))),
    Switch("TITAN_MEGAMOE_WGRAD_TRIM_K", "1", attrs=(("titan_megamoe.kernels.ws_wgrad", "TRIM_K"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1_GRID", "0", attrs=(("titan_megamoe.kernels.ws_gemm", "GEMM1_GRID"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1_EXPERT_ORDER", "1",
           attrs=(("titan_megamoe.kernels.ws_gemm", "GEMM1_EXPERT_ORDER"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1_DYNAMIC", "0", attrs=(("titan_megamoe.kernels.ws_gemm", "GEMM1_DYNAMIC"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1", "1", attrs=(("titan_megamoe.kernels.grouped_gemm", "WS_GEMM1"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM2", "1", attrs=(("titan_megamoe.kernels.grouped_gemm", "WS_GEMM2"),)),
    Switch("TITAN_MEGAMOE_FUSED_LAYER", "1", attrs=(("titan_megamoe.ops.eager_layer", "ENABLED"),)),
    Switch("TITAN_MEGAMOE_FUSED_GATE", "1", attrs=(("titan_megamoe.ops.eager_layer", "FUSED_GATE"),)),
    Switch("TITAN_MEGAMOE_FP8_FAST_FWD", "1", attrs=(("titan_megamoe.ops.eager_layer_fp8", "FAST_FWD"),)),
    Switch("TITAN_MEGAMOE_ROUTER_BWD_KERNEL", "1", attrs=(("titan_megamoe.kernels.router", "BWD_KERNEL"),)),
    Switch("TITAN_MEGAMOE_ROUTER_DX_IN_SCATTER", "1",
           attrs=(("titan_megamoe.ops.eager_layer", "ROUTER_DX_IN_SCATTER"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM2_DGRAD", "0", attrs=(("titan_megamoe.kernels.grouped_gemm_bwd", "WS_GEMM2_DGRAD"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1_DGRAD", "coop", values=("0", "pingpong", "coop", "split"),
           attrs=(("titan_megamoe.kernels.grouped_gemm_bwd", "WS_GEMM1_DGRAD"),)),
    Switch("TITAN_MEGAMOE_WS_WGRAD_SPLIT", "auto", values=("auto", "1", "0"),
           attrs=(("titan_megamoe.kernels.grouped_gemm_wgrad", "WS_WGRAD_SPLIT"),)),
    Switch("TITAN_MEGAMOE_FP8_WGRAD", "fp8", values=("fp8", "bf16", "fp8_acc32"),
           attrs=(("titan_megamoe.ops.fp8_backend", "_WGRAD"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1_FP8", "1", attrs=(("titan_megamoe.ops.fp8_backend", "WS_GEMM1_FP8"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM1_DGRAD_FP8", "1",
           attrs=(("titan_megamoe.ops.fp8_backend", "WS_GEMM1_DGRAD_FP8"),)),
    Switch("TITAN_MEGAMOE_WS_WGRAD_FP8", "1", attrs=(("titan_megamoe.ops.fp8_backend", "WS_WGRAD_FP8"),)),
    Switch("TITAN_MEGAMOE_FP8_WGRAD_CONSUMER", "smem", values=("smem", "v1"),
           attrs=(("titan_megamoe.kernels.ws_wgrad_fp8", "CONSUMER"),)),
    Switch("TITAN_MEGAMOE_FP8_FWD_WIDE", "0", attrs=(("titan_megamoe.ops.fp8_backend", "FP8_FWD_WIDE"),)),
    Switch("TITAN_MEGAMOE_FP8_GEMM1_QUANT_H", "1",
           attrs=(("titan_megamoe.ops.fp8_backend", "FP8_GEMM1_QUANT_H"),)),
    Switch("TITAN_MEGAMOE_FP8_DGRAD_WIDE", "1", attrs=(("titan_megamoe.ops.fp8_backend", "FP8_DGRAD_WIDE"),)),
    Switch("TITAN_MEGAMOE_FP8_GEMM2_WIDE", "1", attrs=(("titan_megamoe.ops.fp8_backend", "FP8_GEMM2_WIDE"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8", "auto", values=("auto", "0", "1", "pingpong"),
           attrs=(("titan_megamoe.ops.fp8_backend", "WS_GEMM2_DGRAD_FP8"),)),
    Switch("TITAN_MEGAMOE_WS_GEMM2_FP8", "1", attrs=(("titan_megamoe.ops.fp8_backend", "WS_GEMM2_FP8"),)),
    Switch("TITAN_MEGAMOE_FP8_WEIGHT_T_KERNEL", "1",
           attrs=(("titan_megamoe.ops.fp8_backend", "FP8_WEIGHT_T_KERNEL"),)),
    Switch("TITAN_MEGAMOE_FP8_ORDERED_MMA", "0", attrs=(("titan_megamoe.kernels.ws_gemm_fp8", "ORDERED_MMA"),)),
    Switch("TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA", "auto", values=("auto", "1", "0"),
           attrs=(("titan_megamoe.kernels.grouped_gemm_fp8_bwd", "GEMM2_DGRAD_FP8_2CTA"),),
           caches=(("titan_megamoe.kernels.grouped_gemm_fp8_bwd", "fp8_bwd_config_for"),)),
    Switch("TITAN_MEGAMOE_FP8_QUANT_GLUON", "1", attrs=(("titan_megamoe.kernels.fp8_quant_bwd", "QUANT_GLUON"),)),
    Switch("TITAN_MEGAMOE_FP8_QUANT_PIPE", "1", attrs=(("titan_megamoe.kernels.fp8_quant_bwd", "QUANT_PIPE"),)),
    Switch("TITAN_MEGAMOE_FP8_QUANT_COLS", "warp", values=("warp", "cta"),
           attrs=(("titan_megamoe.kernels.gl_quant_bwd", "QUANT_COLS"),)),
    Switch("TITAN_MEGAMOE_PERSISTENT_GEMM2_FP8", "1",
           attrs=(("titan_megamoe.kernels.configs", "PERSISTENT_GEMM2_FP8"),
                  ("titan_megamoe.kernels.grouped_gemm_fp8", "PERSISTENT_GEMM2_FP8")),
           caches=(("titan_megamoe.kernels.grouped_gemm_fp8", "fp8_config_for"),)),
)}


def parse_switches(spec: str) -> dict[str, str]:
    """``"FUSED_ROUTER=0,PERSISTENT_GEMM2=0"`` -> {env: value}; the ``TITAN_MEGAMOE_`` prefix is optional.

    Raises:
        ValueError: an entry without ``=``, a switch not in :data:`SWITCHES` (naming the ones there
            and why others are not), a value the switch does not take, or a switch given twice.
    """
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"switch {item!r}: expected NAME=VALUE, e.g. FUSED_ROUTER=0")
        env = name.strip() if name.strip().startswith(PREFIX) else PREFIX + name.strip()
        sw = SWITCHES.get(env)
        if sw is None:
            known = ", ".join(s.removeprefix(PREFIX) for s in SWITCHES)
            raise ValueError(f"switch {name!r} cannot be flipped inside a process (known: {known}); "
                             "compare the others in separate processes (titan_megamoe/switches.py says why)")
        value = value.strip()
        if value not in sw.values:
            raise ValueError(f"switch {env}={value!r}: expected one of {', '.join(sw.values)}")
        if env in out:
            raise ValueError(f"switch {env} given twice in {spec!r}")
        out[env] = value
    return out


def label(settings: dict[str, str]) -> str:
    """Short text of ``settings`` for tables: ``"FUSED_ROUTER=0,PERSISTENT_GEMM2=0"`` ("" for none)."""
    return ",".join(f"{k.removeprefix(PREFIX)}={v}" for k, v in settings.items())


def _clear(sw: Switch) -> None:
    for mod, fn in sw.caches:
        getattr(importlib.import_module(mod), fn).cache_clear()


@contextlib.contextmanager
def override(settings: dict[str, str]):
    """Run the body with ``settings`` ({env: value}, as :func:`parse_switches` returns) in force:
    environment variables, the module attributes read from them at import, and the config caches;
    everything restored on exit, even on an error.

    Raises:
        ValueError: a switch not in :data:`SWITCHES` or a value it does not take.
    """
    for env, value in settings.items():
        if env not in SWITCHES or value not in SWITCHES[env].values:
            raise ValueError(f"override: {env}={value!r} is not a known switch value (see parse_switches)")
    # import every module that reads a switch at import before any variable is set: a module first imported
    # inside the override would read the overridden value, save it as the "old" one and keep it after the exit
    # (the fp8 layer rows of sessions 20-21 ran the Gluon FP8 wgrad "by default" after a bf16 row with the switch on)
    for env in settings:
        for mod, _ in SWITCHES[env].attrs + SWITCHES[env].caches:
            importlib.import_module(mod)
    saved_env = {env: os.environ.get(env) for env in settings}
    saved_attrs = []
    try:
        for env, value in settings.items():
            sw = SWITCHES[env]
            os.environ[env] = value
            for mod, attr in sw.attrs:
                m = importlib.import_module(mod)
                saved_attrs.append((m, attr, getattr(m, attr)))
                setattr(m, attr, value == "1" if sw.values == ("0", "1") else value)
            _clear(sw)
        yield
    finally:
        for m, attr, old in reversed(saved_attrs):
            setattr(m, attr, old)
        for env, old in saved_env.items():
            if old is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = old
        for env in settings:
            _clear(SWITCHES[env])
