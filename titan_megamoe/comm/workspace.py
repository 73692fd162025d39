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
ids         (R, T_cap, K)          int32   source ranks: local expert id of each slot, -1 if the
                                           slot's expert lives elsewhere or t >= T (every row
                                           rewritten every call, so nothing stale is read)
scores      (R, T_cap, K)          fp32    source ranks (0 where ids is -1)
comb        (R, T_cap, D)          fp32    destination ranks: their pre-summed rows for this
                                           rank's tokens (forward output, backward dx)
dscore      (T_cap, K)             fp32    the owner rank of each slot (backward d score)
xflag       (R, NB)                int32   source ranks (overlap v2): epoch of the call whose x
                                           rows of token block b (FB = ``flag_block`` tokens,
                                           NB = ceil(T_cap / FB)) have landed here; never reset
                                           (the epoch grows every call, see comm/signals.py)
==========  =====================  ======  ==================================================

Size: ``R * T_cap * (8 D + 8 K) + 4 T_cap K + 4 R NB`` bytes (+ alignment). Qwen3-30B-A3B, EP = 2,
16384 tokens: 0.54 GB per GPU; Qwen3-235B-A22B, EP = 8, 16384 tokens: 4.3 GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["WorkspaceLayout", "workspace_bytes"]

_ALIGN = 256
_REGIONS = (  # name, dtype, shape as a function of (R, T_cap, D, K)
    ("x", torch.bfloat16, lambda R, T, D, K: (R, T, D)),
    ("dy", torch.bfloat16, lambda R, T, D, K: (R, T, D)),
    ("ids", torch.int32, lambda R, T, D, K: (R, T, K)),
    ("scores", torch.float32, lambda R, T, D, K: (R, T, K)),
    ("comb", torch.float32, lambda R, T, D, K: (R, T, D)),
    ("dscore", torch.float32, lambda R, T, D, K: (T, K)),
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
            shape = shape_fn(world, t_cap, dim, top_k)
            pos = -(-pos // _ALIGN) * _ALIGN
            offsets[name], shapes[name], dtypes[name] = pos, shape, dtype
            n = 1
            for s in shape:
                n *= s
            pos += n * dtype.itemsize
        return WorkspaceLayout(world, t_cap, dim, top_k, flag_block, offsets, shapes, dtypes,
                               -(-pos // _ALIGN) * _ALIGN)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of region ``name`` of this rank's uint8 buffer ``buf`` (no copy)."""
        n = 1
        for s in self.shapes[name]:
            n *= s
        dt = self.dtypes[name]
        start = self.offsets[name]
        return buf[start:start + n * dt.itemsize].view(dt).view(self.shapes[name])

    def describe(self) -> str:
        """One log line: the sizes and the GiB, for the start of training."""
        return (f"megamoe EP workspace: R={self.world}, T_cap={self.t_cap}, D={self.dim}, K={self.top_k}: "
                f"{self.nbytes / 2**30:.3f} GiB per GPU (R*T_cap*(8D+8K) + 4*T_cap*K + 4*R*NB bytes)")


def workspace_bytes(world: int, t_cap: int, dim: int, top_k: int) -> int:
    """Bytes of one rank's workspace (the documented formula, plus alignment; the sync area of
    comm/signals.py comes on top)."""
    return WorkspaceLayout.build(world, t_cap, dim, top_k).nbytes
