"""Triton kernels of the compute codec's dense stages (shared/rdquant.py's CudaProjection):
the PCA projection fused with the shared-step quantizer and the per-component statistics the
rANS coder needs, and its inverse. Imported on first use, so importing rdquant needs no Triton.
"""
import triton
import triton.language as tl

@triton.jit
def _rows_slice(x_ptr, rows, rmask, dd, D, X_TABLE: tl.constexpr, UPCAST: tl.constexpr):
    """x[rows, dd] as a bf16 tile (float32 under the CPU interpreter, which cannot multiply bf16)."""
    a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + dd[None, :], mask=rmask[:, None] & (dd < D)[None, :],
                other=0.0)
    if X_TABLE:
        a = a.to(tl.bfloat16)  # round to nearest even, as torch's .to(torch.bfloat16) on the other path
    return a.to(tl.float32) if UPCAST else a


@triton.jit
def _basis_slice(basis_ptr, dd, cols, cmask, D, K, UPCAST: tl.constexpr):
    b = tl.load(basis_ptr + dd.to(tl.int64)[:, None] * K + cols[None, :], mask=(dd < D)[:, None] & cmask[None, :],
                other=0.0)
    return b.to(tl.float32) if UPCAST else b


@triton.jit
def _batch_member(x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr, inv_step_ptr, T, D, K,
                  X_TABLE: tl.constexpr, X_DTYPE: tl.constexpr):
    """Tensor s = program_id(1) of a batch of same-shape tensors: its input (X_TABLE: read from the address
    table), basis, bias, symbols and statistics, and its 1 / step."""
    seg = tl.program_id(1).to(tl.int64)
    if X_TABLE:
        x_ptr = tl.multiple_of(tl.load(x_ptr + seg).to(tl.pointer_type(X_DTYPE)), 16)
    else:
        x_ptr += seg * T * D
    return (x_ptr, basis_ptr + seg * D * K, bias_ptr + seg * K, sym_ptr + seg * T * K, mn_ptr + seg * K,
            mx_ptr + seg * K, sum_ptr + seg * K, amax_ptr + seg, tl.load(inv_step_ptr + seg))


@triton.jit
def project_quantize_kernel(x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr,
                            T, D, K, inv_step_ptr, SIZE_CLASS,
                            BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr,
                            ROW_WAVES: tl.constexpr = 0, X_TABLE: tl.constexpr = False,
                            X_DTYPE: tl.constexpr = tl.bfloat16, SUM32: tl.constexpr = False):
    """sym = round(((x @ basis) - bias) * inv_step), int32 [T, K] (int16 where sym_ptr is,
    wrapped beyond it); with bias = mean @ basis; for tensor s = program_id(2) of a batch of
    same-shape tensors, each with its own basis and step.

    Also folds each column's min, max and integer sum into mn/mx/sum (atomics), and the largest
    |scaled value| (inf for a NaN) into amax, so the caller can refuse int32 overflow and NaN/Inf.
    A program walks the row tiles program_id(0), + num_programs(0), ... (ROW_WAVES, read by the
    launch grid only: that many programs per SM, 0 for a program per tile) and keeps its columns'
    statistics in registers until the end: one reduction and one atomic per column and program,
    where a program per tile of a long tensor queues thousands on each column's address (256 MB on
    an NVIDIA H200: 644 -> 532 us). X_TABLE: x_ptr holds int64 addresses instead, one contiguous [T, D] tensor of
    X_DTYPE at each, 16-byte aligned, rounded to bf16 as it is read (a CUDA graph then reads new
    tensors where they are: no copy into its own).

    Grid: (row programs x column tiles, N), the column tile varying fastest, so the programs that
    read the same rows of x run side by side and all but the first find them in L2.
    amax comes from the extremes, not a running |value| (a fifth register a value: 256 MB on an
    NVIDIA H200, 433 -> 376 us): NaN is stored as the clamp, and amax is inf wherever a value
    reached it (NaN, Inf, or beyond int32).
    SUM32 (int16 symbols, and at most 2^16 - 1 row tiles a program): the running sums add the stored
    int16 values in int32, one register a value instead of two (on an NVIDIA H200: 64 MB 104 -> 94
    us, 256 MB 379 -> 342, 60 x [1024, 192] 58 -> 51). Exact for every component within int16; one beyond it is coded
    again from int32 symbols (rans_cuda's narrow check reads min and max, which stay exact), so its
    wrapped sum is never used.
    For D <= 3 BD (hoists): the program's [D, BN] slice of the basis is loaded once, before the row
    tiles, and each tile is three products of [BM, BD] x [BD, BN], so the row-tile loop is the one
    the compiler pipelines (the next tiles' rows load while this one is multiplied) and no tile
    reads the basis again. Wider tensors take project_quantize_wide_kernel."""
    n_n = tl.cdiv(K, BN)
    pid_m = tl.program_id(0) // n_n
    n_m = tl.num_programs(0) // n_n
    pid_n = tl.program_id(0) % n_n
    x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr, inv_step = _batch_member(
        x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr, inv_step_ptr, T, D, K, X_TABLE, X_DTYPE)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < K
    bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
    big = 2147483647
    # running statistics element by element, reduced over rows once per program: reducing every
    # tile across its warps cost about as much as the GEMM (256 MB on an NVIDIA H200: 473 us so, a
    # variant without statistics 267, this way 411)
    clamp = 2147483520.0  # the largest float32 below 2^31: values beyond it are refused via amax
    run_mn = tl.full([BM, BN], big, tl.int32)
    run_mx = tl.full([BM, BN], -big - 1, tl.int32)
    run_sum = tl.zeros([BM, BN], tl.int32 if SUM32 else tl.int64)
    d_first = tl.arange(0, BD)
    b0 = _basis_slice(basis_ptr, d_first, cols, cmask, D, K, UPCAST)
    b1 = _basis_slice(basis_ptr, BD + d_first, cols, cmask, D, K, UPCAST)
    b2 = _basis_slice(basis_ptr, 2 * BD + d_first, cols, cmask, D, K, UPCAST)
    for tile in range(pid_m, tl.cdiv(T, BM), n_m):
        rows = tile * BM + tl.arange(0, BM)
        rmask = rows < T
        a0 = _rows_slice(x_ptr, rows, rmask, d_first, D, X_TABLE, UPCAST)
        a1 = _rows_slice(x_ptr, rows, rmask, BD + d_first, D, X_TABLE, UPCAST)
        a2 = _rows_slice(x_ptr, rows, rmask, 2 * BD + d_first, D, X_TABLE, UPCAST)
        acc = tl.dot(a0, b0)
        acc = tl.dot(a1, b1, acc)
        acc = tl.dot(a2, b2, acc)
        v = (acc - bias[None, :]) * inv_step
        m = rmask[:, None] & cmask[None, :]
        v = tl.where(v == v, tl.minimum(tl.maximum(v, -clamp), clamp), clamp)  # refused by the caller via amax
        s = tl.floor(v + 0.5).to(tl.int32)
        tl.store(sym_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], s, mask=m)
        run_mn = tl.minimum(run_mn, tl.where(m, s, big))
        run_mx = tl.maximum(run_mx, tl.where(m, s, -big - 1))
        if SUM32:
            run_sum += tl.where(m, s.to(tl.int16).to(tl.int32), 0)
        else:
            run_sum += tl.where(m, s, 0).to(tl.int64)
    col_mn = tl.min(run_mn, 0)
    col_mx = tl.max(run_mx, 0)
    tl.atomic_min(mn_ptr + cols, col_mn, mask=cmask)
    tl.atomic_max(mx_ptr + cols, col_mx, mask=cmask)
    tl.atomic_add(sum_ptr + cols, tl.sum(run_sum.to(tl.int64), 0), mask=cmask)
    # |symbol| < clamp exactly where the scaled value was finite and within it
    ext = tl.maximum(tl.abs(tl.where(cmask, col_mn, 0).to(tl.float32)), tl.where(cmask, col_mx, 0).to(tl.float32))
    tl.atomic_max(amax_ptr, tl.max(tl.where(ext >= clamp, float("inf"), ext), 0))


@triton.jit
def project_quantize_wide_kernel(x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr,
                                 T, D, K, inv_step_ptr, SIZE_CLASS,
                                 BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr,
                                 GROUP_M: tl.constexpr, X_TABLE: tl.constexpr = False,
                                 X_DTYPE: tl.constexpr = tl.bfloat16, SUM32: tl.constexpr = False):
    """project_quantize_kernel's outputs for wide tensors (D > 3 BD, where its basis cannot be hoisted):
    a GEMM tiled for the tensor cores (a program per [BM, BN] output tile, tiles grouped by GROUP_M row
    tiles so a group's rows and basis columns stay in L2), the quantizer on the accumulator, and each
    tile's column statistics reduced across its rows and folded in with one atomic per column. At
    D >= 1024 a tile's product is 5x or more the D = 192 one, so the per-tile reduction that made
    project_quantize_kernel keep running statistics in registers (and so tiles of at most 64 x 64,
    about a quarter of the tensor cores' rate) costs little here."""
    n_m = tl.cdiv(T, BM)
    n_n = tl.cdiv(K, BN)
    pid = tl.program_id(0)
    in_group = GROUP_M * n_n
    first_m = (pid // in_group) * GROUP_M
    rows_in_group = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows_in_group
    pid_n = (pid % in_group) // rows_in_group
    x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr, inv_step = _batch_member(
        x_ptr, basis_ptr, bias_ptr, sym_ptr, mn_ptr, mx_ptr, sum_ptr, amax_ptr, inv_step_ptr, T, D, K, X_TABLE, X_DTYPE)
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < T
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < K
    acc = tl.zeros([BM, BN], tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        a = _rows_slice(x_ptr, rows, rmask, dd, D, X_TABLE, UPCAST)
        acc = tl.dot(a, _basis_slice(basis_ptr, dd, cols, cmask, D, K, UPCAST), acc)
    bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
    big = 2147483647
    clamp = 2147483520.0  # as project_quantize_kernel: values beyond it are refused via amax
    v = (acc - bias[None, :]) * inv_step
    m = rmask[:, None] & cmask[None, :]
    v = tl.where(v == v, tl.minimum(tl.maximum(v, -clamp), clamp), clamp)
    s = tl.floor(v + 0.5).to(tl.int32)
    tl.store(sym_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], s, mask=m)
    col_mn = tl.min(tl.where(m, s, big), 0)
    col_mx = tl.max(tl.where(m, s, -big - 1), 0)
    if SUM32:  # the stored int16 values' sum, as project_quantize_kernel's (exact within int16)
        col_sum = tl.sum(tl.where(m, s.to(tl.int16).to(tl.int32), 0), 0).to(tl.int64)
    else:
        col_sum = tl.sum(tl.where(m, s, 0).to(tl.int64), 0)
    tl.atomic_min(mn_ptr + cols, col_mn, mask=cmask)
    tl.atomic_max(mx_ptr + cols, col_mx, mask=cmask)
    tl.atomic_add(sum_ptr + cols, col_sum, mask=cmask)
    ext = tl.maximum(tl.abs(tl.where(cmask, col_mn, 0).to(tl.float32)), tl.where(cmask, col_mx, 0).to(tl.float32))
    tl.atomic_max(amax_ptr, tl.max(tl.where(ext >= clamp, float("inf"), ext), 0))


@triton.jit
def reconstruct_kernel(sym_ptr, basis_t_ptr, mean_ptr, out_ptr, T, D, K, step_ptr, bad_ptr, SIZE_CLASS,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """out = bf16((sym * step) @ basis_t + mean), [T, D]; basis_t is [K, D] bf16; for tensor
    s = program_id(2) of a batch of same-shape tensors, each with its own basis and step.
    bad[s] is set to 1 where an output is not finite (out-of-range parameters of a corrupt blob).
    Grid: (row tiles x column tiles, N), the column tile varying fastest, so the programs that
    read the same rows of symbols run side by side and all but the first find them in L2 (with
    the row tile fastest, a [T, 192] tensor's symbols were read from memory once per column tile)."""
    n_n = tl.cdiv(D, BN)
    pid_m = tl.program_id(0) // n_n
    pid_n = tl.program_id(0) % n_n
    seg = tl.program_id(1).to(tl.int64)
    sym_ptr += seg * T * K
    basis_t_ptr += seg * K * D
    mean_ptr += seg * D
    out_ptr += seg * T * D
    step = tl.load(step_ptr + seg)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < T
    cmask = cols < D
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        s = tl.load(sym_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0)
        a = (s.to(tl.float32) * step).to(tl.bfloat16)
        b = tl.load(basis_t_ptr + kk.to(tl.int64)[:, None] * D + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                    other=0.0)
        if UPCAST:  # Triton's CPU interpreter cannot multiply bf16 tiles
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    out = (acc + mean[None, :]).to(tl.bfloat16)
    m = rmask[:, None] & cmask[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], out, mask=m)
    o = out.to(tl.float32)
    nonfinite = tl.max(tl.max(tl.where(m & ~((o == o) & (tl.abs(o) < float("inf"))), 1, 0), 1), 0)
    if nonfinite > 0:
        tl.atomic_max(bad_ptr + seg, 1)


# Tile shapes tried once per (D, K) and SIZE_CLASS (the bit length of T, which the kernels do not
# read) on a GPU; the fastest is kept (triton.autotune). The tile that wins for a short tensor can
# run a long one at half speed, so the size is part of the key.
_MATMUL_CONFIGS = [
    triton.Config(dict(BM=bm, BN=bn, BD=bd), num_warps=w, num_stages=st)
    for bm, bn, bd, w, st in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                              (64, 128, 64, 4, 4), (128, 64, 64, 4, 3), (256, 64, 64, 8, 3), (64, 64, 64, 4, 3),
                              (256, 128, 64, 8, 3)]
]
# The projection's own tiles: its running statistics take five registers a value besides the
# accumulator, so only tiles of at most 32 values a thread keep them without spilling (wider ones
# took minutes to compile). A program per tile for short tensors; from 64 MB up on an
# NVIDIA H200 the autotuner picks programs that walk several row tiles (ROW_WAVES programs per SM).
# With the basis hoisted (D <= 3 PROJECT_BD), 64 x 64 tiles, 4 warps, 3 stages and 1-2
# programs per SM won at 64 MB, 256 MB and 60 x [1024, 192].
PROJECT_BD = 64
_PROJECT_CONFIGS = [
    triton.Config(dict(BM=bm, BN=bn, BD=PROJECT_BD, ROW_WAVES=waves), num_warps=w, num_stages=st)
    for bm, bn, w, st, waves in [(64, 64, 4, 3, 0), (128, 64, 8, 3, 0), (64, 64, 8, 3, 2), (64, 64, 4, 4, 2),
                                 (128, 64, 8, 3, 2), (64, 64, 4, 3, 1), (64, 64, 4, 3, 2), (128, 64, 8, 3, 1)]
]


def hoists(D: int, BD: int) -> bool:
    """Whether project_quantize_kernel can hold its basis slice as three [BD, BN] blocks (else the wide kernel)."""
    return D <= 3 * BD


def project_grid(T: int, K: int, N: int, sms: int):
    """The projection's launch grid for a config's BM, BN and ROW_WAVES (0: a program per row tile)."""
    def grid(meta):
        tiles, cols = -(-T // meta["BM"]), -(-K // meta["BN"])
        waves = meta.get("ROW_WAVES", 0)
        return (tiles if waves == 0 else max(1, min(tiles, waves * sms // (cols * N)))) * cols, N
    return grid


def wide_grid(T: int, K: int, N: int):
    """project_quantize_wide_kernel's launch grid for a config's BM and BN: a program per output tile."""
    return lambda meta: (-(-T // meta["BM"]) * -(-K // meta["BN"]), N)


def reconstruct_grid(T: int, D: int, N: int):
    """The reconstruction's launch grid for a config's BM and BN."""
    return lambda meta: (-(-T // meta["BM"]) * -(-D // meta["BN"]), N)


# The key names X_DTYPE: inputs read by address arrive as int64 address tables whatever their dtype, so
# without it a tile tuned on bf16 inputs was reused for float32 ones, whose 128-row tiles need more
# shared memory than an H100 has (237,568 of 232,448 bytes) and failed to launch.
PROJECTION_KEY = ["D", "K", "SIZE_CLASS", "SUM32", "X_DTYPE"]
project_quantize_tuned = triton.autotune(_PROJECT_CONFIGS, key=PROJECTION_KEY,
                                         reset_to_zero=["sum_ptr"])(
    project_quantize_kernel)
_RECON_CONFIGS = [triton.Config(dict(BM=c.kwargs["BM"], BN=c.kwargs["BN"], BK=c.kwargs["BD"]),
                                num_warps=c.num_warps, num_stages=c.num_stages) for c in _MATMUL_CONFIGS]
reconstruct_tuned = triton.autotune(_RECON_CONFIGS, key=["D", "K", "SIZE_CLASS"])(reconstruct_kernel)
WIDE_GROUP_M = 8  # row tiles a group of the wide projection's programs walks before the next columns
# The wide projection's tiles (D > 3 PROJECT_BD). Timed one by one on an NVIDIA H100 at 64 MB
# (dev/wide_projection_configs.py, kernel-only): 128 x 256 and 256 x 128 tiles of 8 warps ran at
# 290-303 TFLOP/s for D = 1024 and 475-510 for D = 4096 (cuBLAS's bare GEMM: 685 / 718); 128 x 128
# tiles 214-236 / 363-403, 256 x 256 64-70. 128 x 64 stays for a truncated basis (K of 64).
_WIDE_CONFIGS = [
    triton.Config(dict(BM=bm, BN=bn, BD=64, GROUP_M=group), num_warps=w, num_stages=st)
    for bm, bn, w, st, group in [(128, 256, 8, 3, WIDE_GROUP_M), (128, 256, 8, 4, WIDE_GROUP_M),
                                 (128, 256, 8, 3, 16), (256, 128, 8, 3, 4), (128, 64, 4, 4, WIDE_GROUP_M)]
]
project_quantize_wide_tuned = triton.autotune(_WIDE_CONFIGS, key=PROJECTION_KEY,
                                              reset_to_zero=["sum_ptr"])(project_quantize_wide_kernel)
