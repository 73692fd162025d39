"""Host steps of the expert-parallel Triton backend (EP = R ranks), forward and backward, v1.

Shape legend: T tokens of this rank (<= T_cap), K top_k, D model dim, F expert hidden dim, E_l local
experts, j = src * T_cap + t a slab row of the receive side (see ``comm/workspace.py``).

Forward, on every rank (barriers are stream-ordered, no host sync anywhere):
    barrier  -> earlier users of the shared workspace are done with it
    dispatch_push: ids / scores of all T_cap rows to every rank, x rows once per (token, rank)
    barrier
    receive layout from the ids region (slots of other ranks are -1; capacity ``max_rows``) ->
    GEMM1 (+SwiGLU) gathering slab rows -> GEMM2 (+score) by layout row -> combine_push
    (fp32 pre-sum of a slab row's slots, as bf16 into the source's comb[this rank, t]: comm/workspace.py)
    barrier
    combine_sum: out[t] = sum over ranks holding t's experts, rank order, fp32 -> bf16
Backward: barrier, dispatch_push of x and dy, barrier, GEMM2 dgrad + SwiGLU bwd + d score partials,
dscore_push, wgrads (local experts), GEMM1 dgrad, combine_push of the dx rows, barrier, combine_sum.
The layer keeps gate_up and the receive layout; x is re-dispatched in the backward (the workspace is
shared by all layers, so the forward's slab is gone by then: AMD Primus MegaMoE does the same).

v1 runs the phases back to back. Overlap v2 step 1 (``ep_forward_steps_v2``, opt-in) streams the x
rows into GEMM1 through per-block arrival flags; its backward is v1's. The steps are generators that
yield the barrier's site name at each barrier, so one code path serves the GPU
(``run_with_barriers``: the yield calls ``peers.barrier(site)``, bounded, comm/signals.py) and the CPU
tests, which run R emulated ranks in one process in lockstep (``run_lockstep``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_megamoe.comm.workspace import WorkspaceLayout
from titan_megamoe.kernels import ep_comm
from titan_megamoe.kernels.routing import RoutingLayout, build_routing_layout

__all__ = ["EPRank", "forward_dispatch", "forward_combine", "ep_forward_steps", "ep_forward_steps_v2",
           "FORWARD_STEPS", "backward_dispatch",
           "backward_combine", "ep_backward_steps", "ep_backward_steps_v3", "BACKWARD_STEPS", "run_lockstep",
           "run_with_barriers"]

Steps = Generator[str, None, tuple]  # yields the barrier's site name (comm/signals.py SITES)


@dataclass
class EPRank:
    """What one rank's steps need: its peers, the shared workspace layout and the receive capacity.

    Attributes:
        peers: ``comm.peers.Peers`` (symmetric memory or emulated).
        ws: the workspace layout (R, T_cap, D, K).
        experts_per_rank: E_l.
        max_rows: receive capacity in (token, expert) pairs (``MegaMoEConfig.recv_capacity``).
        block_m: row block of the grouped GEMMs.
    """

    peers: object
    ws: WorkspaceLayout
    experts_per_rank: int
    max_rows: int
    block_m: int
    # typed views of the workspace regions, made once: the buffer never moves, and each view costs a few
    # torch view ops of host time per phase of every layer call (ops/ep_library.py keeps the EPRank)
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def region(self, name: str) -> Tensor:
        v = self._views.get(name)
        if v is None:
            v = self._views[name] = self.ws.view(self.peers.buffer(), name)
        return v

    def received(self, name: str) -> Tensor:
        """Region ``name`` of this rank flattened over (src, t): (R * T_cap, ...)."""
        key = ("received", name)
        v = self._views.get(key)
        if v is None:
            t = self.region(name)
            v = self._views[key] = t.view(t.shape[0] * t.shape[1], *t.shape[2:])
        return v


def _no_mark(label: str) -> None:
    pass


def forward_dispatch(ctx: EPRank, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                     mark: Callable[[str], None] = _no_mark, *, fp8_payload: bool = False,
                     nonfinite_count: Tensor | None = None, name: str | None = None) -> Steps:
    """Prologue of the v1-style EP forwards (bf16 v1 / v3, FP8): barrier (earlier users of the shared
    workspace are done), ids / scores of all T_cap rows and the x rows once per (token, rank) pushed to
    the ranks of their experts, barrier (every rank's rows have landed). ``mark`` labels
    ``barrier0, dispatch, barrier1``.

    ``fp8_payload`` (precision "fp8", ``ops/ep_fp8_backend.py``): the x rows are quantized 1x128 on
    this rank and land as e4m3 + fp32 scales in the xq / xs slab instead of bf16 in x
    (``ep_comm.dispatch_push_fp8``; ``nonfinite_count`` / ``name`` go to it)."""
    p = ctx.peers
    yield "fwd.before_dispatch"
    mark("barrier0")
    if fp8_payload:
        ep_comm.dispatch_push_fp8(x_TD, topk_ids_TK, topk_scores_TK, ctx.ws, p.ptr_table(), p.rank,
                                  ctx.experts_per_rank, nonfinite_count=nonfinite_count, name=name)
    else:
        ep_comm.dispatch_push(x_TD, None, topk_ids_TK, topk_scores_TK, ctx.ws, p.ptr_table(), p.rank,
                              ctx.experts_per_rank)
    mark("dispatch")
    yield "fwd.after_dispatch"
    mark("barrier1")


def forward_combine(ctx: EPRank, y_rows: Tensor, layout: RoutingLayout, topk_ids_TK: Tensor,
                    mark: Callable[[str], None] = _no_mark) -> Steps:
    """Epilogue of the v1-style EP forwards: the weighted expert rows (receive-layout order) pre-summed
    per slab row and pushed to their source ranks, barrier, then out (T, D) bf16 = the fp32 sum over
    ranks in rank order. ``mark`` labels ``combine_push, barrier2, combine_sum``. Returns out."""
    p = ctx.peers
    ep_comm.combine_push(y_rows, layout, ctx.ws, p.ptr_table(), p.rank)
    mark("combine_push")
    yield "fwd.after_combine_push"
    mark("barrier2")
    out = ep_comm.combine_sum(ctx.region("comb"), topk_ids_TK, ctx.experts_per_rank, torch.bfloat16)
    mark("combine_sum")
    return out


def ep_forward_steps(ctx: EPRank, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                     w1: Tensor, w2: Tensor, w3: Tensor, mark: Callable[[str], None] = _no_mark) -> Steps:
    """Forward of one layer on this rank; yields at each barrier.

    ``mark(label)`` is called after each phase (``compare/ep_overlap.py`` records a CUDA event there;
    the default does nothing): labels ``barrier0, dispatch, barrier1, layout, gemm1, gemm2,
    combine_push, barrier2, combine_sum``.

    Returns (via StopIteration.value): (out (T, D) bf16, gate_up (N_cap', 2F) bf16, receive layout).
    """
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd, gemm2_scatter_fwd

    yield from forward_dispatch(ctx, x_TD, topk_ids_TK, topk_scores_TK, mark)
    layout = build_routing_layout(ctx.received("ids"), ctx.experts_per_rank, ctx.block_m, max_rows=ctx.max_rows)
    mark("layout")
    gate_up, h = gemm1_swiglu_fwd(ctx.received("x"), w1, w3, layout)
    mark("gemm1")
    y_rows = gemm2_scatter_fwd(h, w2, ctx.received("scores"), layout, by_row=True)
    mark("gemm2")
    out = yield from forward_combine(ctx, y_rows, layout, topk_ids_TK, mark)
    return out, gate_up, layout


_SIDE: dict = {}


def _side_stream(device: torch.device):
    """One high-priority side stream per device for the v2 row dispatch: pending blocks of a
    higher-priority stream are scheduled before those of GEMM1 (a second guard against starvation,
    after the launch order)."""
    if device not in _SIDE:
        lo, hi = torch.cuda.Stream.priority_range()
        _SIDE[device] = torch.cuda.Stream(device=device, priority=hi)
    return _SIDE[device]


def _row_programs(device: torch.device) -> int:
    """Grid of the v2 row dispatch: a quarter of the SMs (33 on an H200). A dispatch program cannot
    share an SM with a GEMM1 program (registers), so every SM it holds is lost to GEMM1 while the
    rows stream; a quarter is the guess for NVLink-rate stores (to be measured). CPU: 3 programs
    (a persistent loop with a partial last round in the tests)."""
    if device.type != "cuda":
        return 3
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count // 4)


def ep_forward_steps_v2(ctx: EPRank, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                        w1: Tensor, w2: Tensor, w3: Tensor, mark: Callable[[str], None] = _no_mark) -> Steps:
    """Forward of one layer, overlap v2 step 1: the x rows stream in while GEMM1 runs.

        barrier -> metadata (ids / scores of all T_cap rows) to every rank -> barrier (epoch N on
        every rank) -> [side stream, high priority] x rows pushed block by block, each FB-token block
        flagged on its destination with epoch N (release) || [main] receive layout -> GEMM1 whose
        programs wait (acquire, bounded) only for the flag blocks of their rows -> GEMM2 ->
        combine_push -> main joins the side stream -> barrier -> combine_sum.

    No starvation: the row kernel is launched before GEMM1 (the layout kernels sit between them on
    the main stream), its grid is at most the SM count (a persistent loop over (block, destination)
    items), so all its programs are resident before GEMM1's programs can take the SMs, and it never
    waits; its stream has the highest priority. Its grid is a quarter of the SMs (``_row_programs``). A violation would not hang: GEMM1's waits are
    bounded (PeerTimeoutError "fwd.gemm1 waiting for x rows"). Flags are never reset: each call
    waits for its own epoch (the barrier count, equal on all ranks between two barriers).
    In one process (emulated ranks: interpreter, or one GPU) the ``yield None`` lets every rank's row
    dispatch be issued before any GEMM1 (lockstep point, no barrier for real peers).

    ``mark`` labels: ``barrier0, dispatch_meta, barrier1, dispatch_rows (launch), layout, gemm1,
    gemm2, combine_push, join, barrier2, combine_sum``. Returns as ``ep_forward_steps``.
    """
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd, gemm2_scatter_fwd

    p, ws = ctx.peers, ctx.ws
    dev = x_TD.device
    yield "fwd.before_dispatch"
    mark("barrier0")
    ep_comm.dispatch_push(x_TD, None, topk_ids_TK, topk_scores_TK, ws, p.ptr_table(), p.rank, ctx.experts_per_rank,
                          send_rows=False)
    mark("dispatch_meta")
    yield "fwd.after_dispatch"
    mark("barrier1")
    side = _side_stream(dev) if dev.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            ep_comm.dispatch_rows(x_TD, topk_ids_TK, ws, p.ptr_table(), p.rank, ctx.experts_per_rank, p.sync.epoch,
                                  _row_programs(dev))
    else:
        ep_comm.dispatch_rows(x_TD, topk_ids_TK, ws, p.ptr_table(), p.rank, ctx.experts_per_rank, p.sync.epoch,
                              _row_programs(dev))
    # lockstep point for emulated ranks (CPU, or one GPU): every rank's row dispatch is issued before
    # any GEMM1 polls; real peers: no barrier here
    yield None
    mark("dispatch_rows")
    layout = build_routing_layout(ctx.received("ids"), ctx.experts_per_rank, ctx.block_m, max_rows=ctx.max_rows)
    mark("layout")
    wait = p.sync.row_arrival(ctx.region("xflag"), ws.t_cap, ws.flag_block)
    gate_up, h = gemm1_swiglu_fwd(ctx.received("x"), w1, w3, layout, wait=wait)
    mark("gemm1")
    y_rows = gemm2_scatter_fwd(h, w2, ctx.received("scores"), layout, by_row=True)
    mark("gemm2")
    ep_comm.combine_push(y_rows, layout, ws, p.ptr_table(), p.rank)
    mark("combine_push")
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    mark("join")
    yield "fwd.after_combine_push"
    mark("barrier2")
    out = ep_comm.combine_sum(ctx.region("comb"), topk_ids_TK, ctx.experts_per_rank, torch.bfloat16)
    mark("combine_sum")
    return out, gate_up, layout


FORWARD_STEPS = {"v1": ep_forward_steps, "v2": ep_forward_steps_v2, "v3": ep_forward_steps}


def backward_dispatch(ctx: EPRank, x_TD: Tensor, dout_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                      mark: Callable[[str], None] = _no_mark) -> Steps:
    """Prologue of every EP backward (bf16 v1 / v3, FP8): barrier (earlier users of the workspace are
    done), then ids / scores of all T_cap rows and the x and dy rows once per (token, rank) pushed to
    the ranks of their experts, then barrier (every rank's rows have landed). ``mark`` labels
    ``barrier0, dispatch, barrier1``."""
    p = ctx.peers
    yield "bwd.before_dispatch"
    mark("barrier0")
    ep_comm.dispatch_push(x_TD, dout_TD, topk_ids_TK, topk_scores_TK, ctx.ws, p.ptr_table(), p.rank,
                          ctx.experts_per_rank)
    mark("dispatch")
    yield "bwd.after_dispatch"
    mark("barrier1")


def backward_combine(ctx: EPRank, T: int, topk_ids_TK: Tensor, mark: Callable[[str], None] = _no_mark) -> Steps:
    """Epilogue of every EP backward, after this rank's dx rows and d scores were pushed: barrier (every
    rank's pushes have landed), then dx (T, D) bf16 = the fp32 sum over ranks in rank order and this
    rank's d scores (T, K) fp32. ``mark`` labels ``barrier2, combine_sum``. Returns (dx, dscores)."""
    yield "bwd.after_combine_push"
    mark("barrier2")
    dx = ep_comm.combine_sum(ctx.region("comb"), topk_ids_TK, ctx.experts_per_rank, torch.bfloat16)
    dscores = ctx.region("dscore")[:T].clone()
    mark("combine_sum")
    return dx, dscores


def ep_backward_steps(ctx: EPRank, dout_TD: Tensor, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                      w1: Tensor, w2: Tensor, w3: Tensor, gate_up: Tensor, layout: RoutingLayout,
                      mark: Callable[[str], None] = _no_mark) -> Steps:
    """Backward of one layer on this rank; yields at each barrier. ``mark`` as in the forward, labels
    ``barrier0, dispatch, barrier1, gemm2_dgrad, dscore_push, wgrad_w2, wgrad_w13, gemm1_dgrad,
    combine_push, barrier2, combine_sum``.

    Returns: (dx (T, D) bf16, dscores (T, K) fp32, dw1, dw2, dw3 of the local experts).
    """
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad, gemm2_dgrad_swiglu_bwd, wgrad_w2, wgrad_w13

    p, ws = ctx.peers, ctx.ws
    yield from backward_dispatch(ctx, x_TD, dout_TD, topk_ids_TK, topk_scores_TK, mark)
    x_r, dy_r, sc_r = ctx.received("x"), ctx.received("dy"), ctx.received("scores")
    hs = torch.empty((layout.n_cap, w1.shape[1]), dtype=gate_up.dtype, device=gate_up.device)
    dgate_up, part = gemm2_dgrad_swiglu_bwd(dy_r, w2, gate_up, sc_r, layout, hs_out=hs)
    mark("gemm2_dgrad")
    ep_comm.dscore_push(part, layout, ws, p.ptr_table())
    mark("dscore_push")
    dw2 = wgrad_w2(dy_r, gate_up, sc_r, layout, hs_NF=hs)
    mark("wgrad_w2")
    dw1, dw3 = wgrad_w13(dgate_up, x_r, layout)
    mark("wgrad_w13")
    dx_rows = gemm1_dgrad(dgate_up, w1, w3, layout)
    mark("gemm1_dgrad")
    ep_comm.combine_push(dx_rows, layout, ws, p.ptr_table(), p.rank)
    mark("combine_push")
    dx, dscores = yield from backward_combine(ctx, x_TD.shape[0], topk_ids_TK, mark)
    return dx, dscores, dw1, dw2, dw3


def ep_backward_steps_v3(ctx: EPRank, dout_TD: Tensor, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                         w1: Tensor, w2: Tensor, w3: Tensor, gate_up: Tensor, layout: RoutingLayout,
                         mark: Callable[[str], None] = _no_mark) -> Steps:
    """Backward of one layer with the NVLink pushes under the weight gradients (overlap v3):

        barrier -> dispatch x, dy -> barrier -> GEMM2 dgrad -> GEMM1 dgrad -> [side stream, high
        priority] d score push + dx combine push || [main] wgrad_w2, wgrad_w13 -> join -> barrier ->
        combine_sum

    v1 pushes after the wgrads, with nothing to hide them under; here the wgrads (no cross-rank data)
    run while the dx rows and d scores travel. Same kernels and reduction orders as v1: bitwise the
    same results. Cost: the dx rows (N_cap' x D bf16) are alive during the wgrads (v1 allocates them
    after), so peak memory grows by up to one gathered operand of the wgrad (0.3-0.6 GiB at the 30B
    shape). ``mark`` labels: ``barrier0, dispatch, barrier1, gemm2_dgrad, gemm1_dgrad, pushes
    (launch), wgrad_w2, wgrad_w13, join, barrier2, combine_sum``.

    Returns: as ``ep_backward_steps``.
    """
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad, gemm2_dgrad_swiglu_bwd, wgrad_w2, wgrad_w13

    p, ws = ctx.peers, ctx.ws
    dev = x_TD.device
    yield from backward_dispatch(ctx, x_TD, dout_TD, topk_ids_TK, topk_scores_TK, mark)
    x_r, dy_r, sc_r = ctx.received("x"), ctx.received("dy"), ctx.received("scores")
    hs = torch.empty((layout.n_cap, w1.shape[1]), dtype=gate_up.dtype, device=gate_up.device)
    dgate_up, part = gemm2_dgrad_swiglu_bwd(dy_r, w2, gate_up, sc_r, layout, hs_out=hs)
    mark("gemm2_dgrad")
    dx_rows = gemm1_dgrad(dgate_up, w1, w3, layout)
    mark("gemm1_dgrad")
    side = _side_stream(dev) if dev.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            ep_comm.dscore_push(part, layout, ws, p.ptr_table())
            ep_comm.combine_push(dx_rows, layout, ws, p.ptr_table(), p.rank)
    else:
        ep_comm.dscore_push(part, layout, ws, p.ptr_table())
        ep_comm.combine_push(dx_rows, layout, ws, p.ptr_table(), p.rank)
    mark("pushes")
    dw2 = wgrad_w2(dy_r, gate_up, sc_r, layout, hs_NF=hs)
    del hs
    mark("wgrad_w2")
    dw1, dw3 = wgrad_w13(dgate_up, x_r, layout)
    mark("wgrad_w13")
    if side is not None:
        # part / dx_rows were allocated on the main stream and stay referenced until here, so the
        # allocator cannot hand their memory to main-stream work the side stream has not finished
        torch.cuda.current_stream(dev).wait_stream(side)
    mark("join")
    dx, dscores = yield from backward_combine(ctx, x_TD.shape[0], topk_ids_TK, mark)
    return dx, dscores, dw1, dw2, dw3


#: Backward steps of each overlap mode (the forward's are FORWARD_STEPS; v3 = v1's forward).
BACKWARD_STEPS = {"v1": ep_backward_steps, "v2": ep_backward_steps, "v3": ep_backward_steps_v3}


def run_with_barriers(steps: Steps, peers) -> tuple:
    """Run one rank's steps, calling ``peers.barrier(site)`` at each named yield (the GPU path;
    bounded: a rank that never arrives is recorded in ``peers.sync.status``, see comm/signals.py);
    ``yield None`` is a lockstep point of the emulated ranks only, no barrier."""
    while True:
        try:
            site = next(steps)
        except StopIteration as done:
            return done.value
        if site is not None:
            peers.barrier(site)


def run_lockstep(all_steps: list[Steps], peers: list | None = None) -> list[tuple]:
    """Run R emulated ranks' steps in one process: every rank reaches barrier b before any rank goes
    past it (the CPU tests' stand-in for a barrier). With ``peers`` (emulated), each rank's
    ``barrier(site)`` is called at its named yields, so its epoch advances as a real barrier's does
    (overlap v2 tags its arrival flags with it).

    Raises:
        RuntimeError: the ranks yield different numbers of barriers (a real run would hang).
    """
    results: list = [None] * len(all_steps)
    live = list(range(len(all_steps)))
    while live:
        finished = []
        for r in live:
            try:
                site = next(all_steps[r])
            except StopIteration as done:
                results[r] = done.value
                finished.append(r)
                continue
            if peers is not None and site is not None:
                peers[r].barrier(site)
        if finished and len(finished) != len(live):
            raise RuntimeError(f"ranks {finished} finished while ranks {sorted(set(live) - set(finished))} "
                               "wait at a barrier: the steps differ between ranks")
        live = [r for r in live if r not in finished]
    return results
