"""Byte layout of the expert-parallel workspace: one buffer per process, shared by every MoE layer.

Shape legend: R EP ranks, T_cap tokens per rank per call (``max_tokens_per_rank``), D model dim,
K top_k. A source rank's token t always lands at *slab row* ``src * T_cap + t`` of a destination's
buffers (one copy per (token, destination) rank, whatever the number of its experts there), so no
counts are exchanged and no row can overflow the slab; the expert-major layout built on the
destination points into the slab.

Regions of every rank's buffer (each 256-byte aligned):

==========  =====================  ======  ==================================================
name        shape                  dtype   written by
==========  =====================  ======  ==================================================
x           (R, T_cap, D)          bf16    source ranks (dispatch of the layer input)
dy          (R, T_cap, D)          bf16    source ranks (dispatch of d out, backward)
xq          (R, T_cap, D)          e4m3    source ranks (FP8 payload of the "fp8" forward:
                                           x quantized 1x128 on the source); inside dy
xs          (R, T_cap, D/128)      fp32    source ranks: xq's scale per 128 channels (the
                                           last dim is ceil(D / 128)); inside dy, after xq
ids         (R, T_cap, K)          int32   source ranks: local expert id of each slot, -1 if the
                                           slot's expert lives elsewhere or t >= T (every row
                                           rewritten every call, so nothing stale is read)
scores      (R, T_cap, K)          fp32    source ranks (0 where ids is -1)
comb        (R, T_cap, D)          bf16    destination ranks: their pre-summed rows for this
                                           rank's tokens (forward output, backward dx); fp32
                                           with TITAN_MEGAMOE_COMBINE_DTYPE=fp32 (below)
dscore      (T_cap, K)             fp32    the owner rank of each slot (backward d score)
xflag       (R, NB)                int32   source ranks (overlap v2): epoch of the call whose x
                                           rows of token block b (FB = ``flag_block`` tokens,
                                           NB = ceil(T_cap / FB)) have landed here; never reset
                                           (the epoch grows every call, see comm/signals.py)
==========  =====================  ======  ==================================================

Bytes per dispatched row (one (token, destination) pair): bf16 ``2 D`` (x, dy); FP8 ``D + 4 D / 128``
(xq row + xs row: 2112 bytes at D = 2048 instead of 4096).

The FP8 slab (xq, xs) *overlays* the dy region: dy is written only by a backward's dispatch and read
only before that backward's last barrier; xq / xs are written only by an FP8 forward's dispatch and
read only by its GEMM1, before that forward's last barrier. Every call starts with a barrier (no peer
writes into this buffer before this rank has finished the previous call's reads: the stream orders
them before its arrival), so the two are never alive at the same time, as the x slab is shared by
all layers. The dy region is sized ``max(2 D, D + 4 ceil(D / 128) + alignment)`` bytes per row,
which is ``2 D`` for any D >= 128 and R * T_cap >= 2.

The comb rows are bf16: a destination sums a token's slots on it in fp32 (k order) and rounds that
partial sum once to bf16 for the trip back; the source sums the ranks' partials in fp32 (rank order)
and rounds once more to the bf16 output. Half the bytes of fp32 partials on the wire (the combine is
the largest transfer: 134 MB of fp32 per rank and direction at the 30B shape, EP 2) for at most one
extra bf16 rounding per rank holding two or more of the token's slots; with one slot per rank the
partial *is* the bf16 expert row, so top-1 / top-2 results are unchanged bit for bit. DeepGEMM's
Mega MoE and stock TorchTitan move bf16 expert rows too (per slot). ``TITAN_MEGAMOE_COMBINE_DTYPE=fp32``
(read at import, the same on every rank) keeps fp32 partials.

Size: ``R * T_cap * (6 D + 8 K) + 4 T_cap K + 4 R NB`` bytes (+ alignment; ``8 D`` with fp32 comb rows;
unchanged by the FP8 slab, which lives in dy). Qwen3-30B-A3B, EP = 2, 16384 tokens: 0.40 GB per GPU;
Qwen3-235B-A22B, EP = 8, 16384 tokens: 3.2 GB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

__all__ = ["COMBINE_DTYPE", "WorkspaceLayout", "workspace_bytes"]

#: dtype of the comb rows (module docstring): bf16, or fp32 with TITAN_MEGAMOE_COMBINE_DTYPE=fp32.
_COMBINE_CHOICES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_combine_env = os.environ.get("TITAN_MEGAMOE_COMBINE_DTYPE", "bf16")
if _combine_env not in _COMBINE_CHOICES:
    raise ValueError(f"TITAN_MEGAMOE_COMBINE_DTYPE={_combine_env!r}: choose one of {sorted(_COMBINE_CHOICES)}")
COMBINE_DTYPE = _COMBINE_CHOICES[_combine_env]

_ALIGN = 256
_REGIONS = (  # name, dtype, shape as a function of (R, T_cap, D, K)
    ("x", torch.bfloat16, lambda R, T, D, K: (R, T, D)),
    ("dy", torch.bfloat16, lambda R, T, D, K: (R, T, D)),
    ("ids", torch.int32, lambda R, T, D, K: (R, T, K)),
    ("scores", torch.float32, lambda R, T, D, K: (R, T, K)),
    ("comb", None, lambda R, T, D, K: (R, T, D)),  # COMBINE_DTYPE, read when a layout is built
    ("dscore", torch.float32, lambda R, T, D, K: (T, K)),
)
#: Regions that share the bytes of another one (never alive at the same time, module docstring):
#: name, dtype, shape, host region. Packed back to back (256-byte aligned) from the host's offset;
#: the host region is grown if they would not fit.
_OVERLAYS = (
    ("xq", torch.float8_e4m3fn, lambda R, T, D, K: (R, T, D), "dy"),
    ("xs", torch.float32, lambda R, T, D, K: (R, T, -(-D // 128)), "dy"),
)
#: Tokens per arrival flag of the v2 dispatch (GEMM1's row block on Hopper).
FLAG_BLOCK = 128


@dataclass(frozen=True)
class WorkspaceLayout:
    """Offsets of the regions in one rank's workspace, for (R, T_cap, D, K).

    Attributes:
        world, t_cap, dim, top_k: R, T_cap, D, K.
        flag_block: FB, tokens per v2 arrival flag (NB = ceil(T_cap / FB) flags per source).
        offsets: region name -> byte offset; shapes / dtypes: as in the module docstring.
        nbytes: total bytes of the buffer.
    """

    world: int
    t_cap: int
    dim: int
    top_k: int
    flag_block: int = FLAG_BLOCK
    offsets: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)
    nbytes: int = 0

    @staticmethod
    def build(world: int, t_cap: int, dim: int, top_k: int, flag_block: int = FLAG_BLOCK) -> "WorkspaceLayout":
        """Lay the regions out back to back, each aligned to 256 bytes.

        Raises:
            ValueError: a non-positive size.
        """
        if min(world, t_cap, dim, top_k, flag_block) < 1:
            raise ValueError(f"workspace sizes must be >= 1 (R={world}, T_cap={t_cap}, D={dim}, K={top_k}, "
                             f"flag_block={flag_block})")
        offsets, shapes, dtypes, pos = {}, {}, {}, 0
        nb = -(-t_cap // flag_block)
        for name, dtype, shape_fn in _REGIONS + (("xflag", torch.int32, lambda R, T, D, K: (R, nb)),):
            dtype = COMBINE_DTYPE if name == "comb" else dtype
            shape = shape_fn(world, t_cap, dim, top_k)
            pos = -(-pos // _ALIGN) * _ALIGN
            offsets[name], shapes[name], dtypes[name] = pos, shape, dtype
            size = _numel(shape) * dtype.itemsize
            inner = pos  # the overlays hosted by this region, packed from its start
            for o_name, o_dtype, o_shape_fn, host in _OVERLAYS:
                if host == name:
                    inner = -(-inner // _ALIGN) * _ALIGN
                    o_shape = o_shape_fn(world, t_cap, dim, top_k)
                    offsets[o_name], shapes[o_name], dtypes[o_name] = inner, o_shape, o_dtype
                    inner += _numel(o_shape) * o_dtype.itemsize
            pos += max(size, inner - pos)
        return WorkspaceLayout(world, t_cap, dim, top_k, flag_block, offsets, shapes, dtypes,
                               -(-pos // _ALIGN) * _ALIGN)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of region ``name`` of this rank's uint8 buffer ``buf`` (no copy)."""
        n = _numel(self.shapes[name])
        dt = self.dtypes[name]
        start = self.offsets[name]
        return buf[start:start + n * dt.itemsize].view(dt).view(self.shapes[name])

    def describe(self) -> str:
        """One log line: the sizes and the GiB, for the start of training."""
        return (f"megamoe EP workspace: R={self.world}, T_cap={self.t_cap}, D={self.dim}, K={self.top_k}: "
                f"{self.nbytes / 2**30:.3f} GiB per GPU (R*T_cap*({4 + 2 * self.dtypes['comb'].itemsize}D+8K) + "
                f"4*T_cap*K + 4*R*NB bytes, {str(self.dtypes['comb']).replace('torch.', '')} combine rows; the "
                f"FP8 x slab, R*T_cap*(D+4*D/128) bytes, shares the dy region)")


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def workspace_bytes(world: int, t_cap: int, dim: int, top_k: int) -> int:
    """Bytes of one rank's workspace (the documented formula, plus alignment; the sync area of
    comm/signals.py comes on top)."""
    return WorkspaceLayout.build(world, t_cap, dim, top_k).nbytes
