"""A minimal Gluon kernel for the sm_90a compile check of ``kernels/sm90_check.py`` (imported only in the
compile subprocess: Gluon kernels are not run by the interpreter the CPU tests use)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def gluon_copy_kernel(x_ptr, y_ptr, n, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    ok = offs < n
    gl.store(y_ptr + offs, gl.load(x_ptr + offs, mask=ok), mask=ok)


from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def gluon_serialized_wgmma_kernel(a_desc, b_desc, c_desc, K):
    """A wgmma loop that leaves one MMA group in flight (wait(1)) across a loop whose accumulator starts
    from zeros: ptxas serializes every wgmma of it (C7515, seen with Triton 3.6's ptxas); the compile
    check must report it."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    phase = 0
    for k in range(0, K, BK):
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [0, k], bar, a_smem)
        tma.async_copy_global_to_shared(b_desc, [k, 0], bar, b_smem)
        mbarrier.wait(bar, phase=phase)
        phase ^= 1
        acc = warpgroup_mma(a_smem, b_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem.store(acc.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [0, 0], c_smem)
    tma.store_wait(pendings=0)
