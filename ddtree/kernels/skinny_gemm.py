"""x @ W.T for a handful of rows at a real model's width, reading the weight near HBM speed.

At batch 1 a decoder step is its GEMMs' weight reads, and cuBLAS's few-row kernels read bfloat16 weights at
48-79% of the H200's copy bandwidth (docs/perf.md, "Findings that explain the code"): a 8-50 MB matrix read in
6-40 us leaves too few bytes in flight per SM for the HBM's latency. This kernel is built for that case:

- The weight is the MMA's wide operand (A and B swapped: W[BLOCK_N, BLOCK_K] @ x.T[BLOCK_K, BLOCK_M]), so a
  tensor-core tile spends its rows on weight rows rather than on padding 1-16 input rows up to 64.
- Its loads feed tl.dot, so Triton pipelines them `stages` deep: each SM keeps tens of KB of weight in
  flight (a multiply-and-sum on the CUDA cores gets no such pipeline).
- When the column blocks alone would not fill the device, K is split over `split` programs. Each writes its
  float32 partial sums to a workspace and counts itself in at an atomic counter of its column block; the
  last to arrive sums the partials, applies the epilogue and stores, then sets the counter back to 0, so the
  next launch (or CUDA-graph replay) starts clean. One launch, no memset, no second reduction kernel.
- A decoder layer's neighbours ride along: RMSNorm of the rows (x times the norm weight goes into the
  product, the sum of squares accumulates beside it from the same loads, and each row's 1 / rms scales its
  sums at the end: a loop of its own over K before the product would not be pipelined and costs more than
  the GEMM saves), SwiGLU's product (W = [gate; up]) and the residual add as the epilogue. With all of
  them a layer at batch 1 is four GEMM launches, the q/k rotation and the attention; the engine uses the
  SwiGLU epilogue only (target.NORMS_IN_SKINNY_GEMMS: the in-GEMM norm was slower on the H200).
- Folded norms (Target.fold_norms: the norm's weight already in W's columns) leave x untouched on its way to
  the tensor cores: the product that wrote x returns its rows' sums of squares by column block
  (`return_sums`, from the values it stored), and the next product adds them up and scales its sums by
  1 / rms at the end (`norm_sums`). Nothing is added to the K loop. The engine folds a 16-bit target at
  real width on CUDA by default (engine.folding_pays).

Numerics: the product, the norm's scale, SwiGLU and the residual add stay in float32 to one rounding at the
store, where the reference rounds after each op (RMSNorm rounds the normalised row before it is scaled; here
x * norm weight is rounded once for the tensor cores). In float32 the two agree to float32 rounding.
The workspace and counters are shared by every call on a device, so calls on one device must not overlap
(the engine runs one stream). `skinny_linear_reference` is the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.kernels.fused_linear import check_inputs, fused_linear_reference

try:  # Triton is optional: CPU machines use the reference (or the interpreter, in tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_ROWS = 64  # x.T is one MMA operand of at most this many columns
STAGED_BYTES = 192 << 10  # the pipelined tiles a program holds (an H200 block has 227 KB of shared memory)


@dataclass(frozen=True)
class Tiles:
    """How one product is cut: weight rows per program, K per load, K splits, pipeline depth, warps."""

    block_n: int = 64
    block_k: int = 128
    split: int = 1
    stages: int = 4
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {value}")
        if self.split < 1 or self.stages < 1 or self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tiles: split >= 1, stages >= 1 and warps in 1/2/4/8/16, got {self}")

    @property
    def label(self) -> str:
        return f"{self.block_n}x{self.block_k} s{self.split} p{self.stages} w{self.warps}"


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any count exercises the split
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_tiles(rows: int, k: int, n_out: int, swiglu: bool, device: torch.device,
                 itemsize: int = 2) -> Tiles:
    """Tiles for a product, from the H200 sweeps (docs/perf.md, "The engine at real width"): 64 weight rows a
    program; with a third of the SMs' worth of column blocks or more, no split and loads of 256 along K (128
    for SwiGLU, whose program reads gate and up rows), halved while four stages of the weight and x tiles
    would not fit in STAGED_BYTES (float32, many rows); with fewer, K split until every SM has a program,
    each split keeping at least four loads of 128 to pipeline. A 16-bit SwiGLU whose 64-row blocks would
    run into a second wave takes 128-row blocks, one wave."""
    block_n, stages = 64, 4
    block_m = max(16, 1 << max(rows - 1, 0).bit_length())
    blocks = -(-n_out // block_n)
    sms = _sm_count(device)
    if swiglu and itemsize == 2 and block_m == 16 and sms < blocks <= 2 * sms:
        # 64-row blocks would make a wave and a part-empty second one; 128-row blocks make one wave (H200, 8b
        # gate/up: 57.9 -> 54.5 us), in three stages (209 KB). Measured for SwiGLU only, at up to 16 rows
        return Tiles(block_n=128, block_k=128, split=1, stages=3, warps=4)
    split, block_k = 1, (128 if swiglu or k < 4 * 256 else 256)
    if 3 * blocks < sms:
        split, block_k = max(1, min(-(-sms // blocks), k // (4 * 128))), 128
    while block_k > 32 and stages * (block_n * (2 if swiglu else 1) + block_m) * block_k * itemsize > STAGED_BYTES:
        block_k //= 2
    return Tiles(block_n=block_n, block_k=block_k, split=split, stages=stages, warps=4)


class _Workspace:
    """Per device: the split programs' float32 partials and one arrival counter per column block.

    Buffers only grow, and a buffer once handed out is never freed: a captured CUDA graph keeps the address
    it was captured with. Growth while a graph is being captured would leave the counters unzeroed until the
    first replay, so it is refused with what to do."""

    COUNTERS = 1 << 14

    def __init__(self) -> None:
        self.counters: dict[torch.device, torch.Tensor] = {}
        self.partials: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, partial_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.partials.setdefault(device, [])
        if device not in self.counters or not held or held[-1].numel() < partial_elems:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("skinny_linear: its workspace must grow while a CUDA graph is being captured; "
                                   "run the same shapes once eagerly before capturing (a warm-up step)")
            if device not in self.counters:
                self.counters[device] = torch.zeros(self.COUNTERS, dtype=torch.int32, device=device)
            held.append(torch.empty(max(partial_elems, 1 << 16), dtype=torch.float32, device=device))
        return self.counters[device], held[-1]


WORKSPACE = _Workspace()


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False,
                            norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                            residual: torch.Tensor | None = None, norm_sums: torch.Tensor | None = None,
                            return_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The models' ops: RMSNorm (layers.RMSNorm's order) when norm_weight is given, F.linear, silu(gate) * up
    of its two halves when swiglu, + residual (fused_linear's reference: the same sequence); with norm_sums,
    F.linear scaled by each row's 1 / rms before SwiGLU (folded_linear_reference)."""
    check_inputs(x, weight, norm_weight, residual, swiglu, who="skinny_linear")
    check_sums(x, norm_weight, norm_sums, return_sums, swiglu, who="skinny_linear")
    if norm_sums is None and not return_sums:
        return fused_linear_reference(x, weight, norm_weight, eps, residual, swiglu)
    return folded_linear_reference(x, weight, swiglu, norm_weight, eps, residual, norm_sums, return_sums)


def folded_linear_reference(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False,
                            norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                            residual: torch.Tensor | None = None, norm_sums: torch.Tensor | None = None,
                            return_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """skinny_linear's folded-norm arguments as torch ops (any row count: what models.layers.linear runs off
    the kernel's route). The sums come back as one part, [1, rows]."""
    if norm_sums is None:
        y = fused_linear_reference(x, weight, norm_weight, eps, None, swiglu)
    else:
        rstd = torch.rsqrt(norm_sums.sum(0) / x.shape[-1] + eps).reshape(*x.shape[:-1], 1)
        y = (torch.nn.functional.linear(x, weight).float() * rstd).to(x.dtype)
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = residual + y
    if not return_sums:
        return y
    return y, y.float().square().sum(-1).reshape(1, -1)


def check_sums(x: torch.Tensor, norm_weight: torch.Tensor | None, norm_sums: torch.Tensor | None,
               return_sums: bool, swiglu: bool, who: str) -> None:
    """norm_sums must be [parts, rows] float32 on x's device, and not beside a norm_weight; return_sums is for
    a product whose output is the residual stream (no SwiGLU)."""
    if norm_sums is not None:
        rows = x[..., 0].numel()
        if norm_weight is not None:
            raise ValueError(f"{who}: norm_sums (a folded norm) and norm_weight are two norms; pass one")
        if norm_sums.dim() != 2 or norm_sums.shape[1] != rows or norm_sums.shape[0] < 1:
            raise ValueError(f"{who}: norm_sums must be [parts >= 1, rows = {rows}], got {tuple(norm_sums.shape)}")
        if norm_sums.dtype != torch.float32 or norm_sums.device != x.device:
            raise ValueError(f"{who}: norm_sums must be float32 on {x.device}, got {norm_sums.dtype} on "
                             f"{norm_sums.device}")
    if return_sums and swiglu:
        raise ValueError(f"{who}: return_sums is for the residual stream's products, not SwiGLU's")


if triton is not None:

    @triton.jit
    def _product(w, xt, acc, UPCAST: tl.constexpr):
        if UPCAST:  # float32 inputs, or the interpreter (whose 16-bit dot is unreliable): IEEE float32
            return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(w, xt, acc)

    @triton.jit
    def _skinny_kernel(
        X, W, NW, R, OUT, PART, COUNT, SUMS_IN, SUMS_OUT,
        n_rows, n_out, k_dim, k_split, eps, sx_m, sw_n, sr_m, so_m, n_sum_parts,
        SPLIT: tl.constexpr, SWIGLU: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
        UPCAST: tl.constexpr, EVEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_SUMS: tl.constexpr = False, RETURN_SUMS: tl.constexpr = False, SUM_PARTS: tl.constexpr = 1,
    ):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        # out-of-range columns read the last weight row (unmasked loads vectorise); their results are dropped
        w_rows = tl.minimum(cols, n_out - 1).to(tl.int64) * sw_n
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        k_lo = pid_s * k_split
        ks = k_lo + tl.arange(0, BLOCK_K)
        w_ptrs = W + w_rows[:, None] + ks[None, :]
        x_ptrs = X + rows[None, :] * sx_m + ks[:, None]
        ss = tl.zeros([BLOCK_M], tl.float32)  # the norm's sum of squares, over this program's part of K
        if HAS_SUMS:  # a folded norm's sums, loaded before the K loop so that their latency hides behind it
            parts = tl.arange(0, SUM_PARTS)
            ss_in = tl.sum(tl.load(SUMS_IN + parts[:, None] * n_rows + rows[None, :],
                                   mask=(parts[:, None] < n_sum_parts) & row_ok[None, :], other=0.0), 0)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + k_split, k_dim), BLOCK_K):
            if EVEN:  # K is a multiple of BLOCK_K (and so is k_split): every load is whole
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_dim
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            if HAS_NORM:  # x * norm weight into the product; the row's 1 / rms scales the sums at the end
                nw = tl.load(NW + k0 + tl.arange(0, BLOCK_K), mask=(k0 + tl.arange(0, BLOCK_K)) < k_dim, other=0.0)
                xf = xt.to(tl.float32)
                ss += tl.sum(xf * xf, 0)
                xt = (xf * nw.to(tl.float32)[:, None]).to(xt.dtype)
            acc = _product(w, xt, acc, UPCAST)
            if SWIGLU:  # the up rows follow the gate rows
                if EVEN:
                    wu = tl.load(w_ptrs + n_out * sw_n)
                else:
                    wu = tl.load(w_ptrs + n_out * sw_n, mask=k_ok[None, :], other=0.0)
                acc_up = _product(wu, xt, acc_up, UPCAST)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        tile = cols[:, None] * BLOCK_M + rows[None, :]  # a column block's partials: [n_out, BLOCK_M] per split
        last = True
        if SPLIT > 1:
            stride = n_out * BLOCK_M
            base = PART + pid_s * (2 if SWIGLU else 1) * stride
            tl.store(base + tile, acc, mask=col_ok[:, None])
            if SWIGLU:
                tl.store(base + stride + tile, acc_up, mask=col_ok[:, None])
            # each split's sums of squares, after all splits' partials: [SPLIT, column blocks, BLOCK_M]
            ss_base = PART + SPLIT * (2 if SWIGLU else 1) * stride + pid_n * BLOCK_M
            ss_stride = tl.num_programs(0) * BLOCK_M
            if HAS_NORM:
                tl.store(ss_base + pid_s * ss_stride + rows, ss)
            tl.debug_barrier()  # every thread's partials are written before the block counts itself in
            arrived = tl.atomic_add(COUNT + pid_n, 1, sem="acq_rel")
            last = arrived == SPLIT - 1
            if last:  # the others' partials, read past L1 (which is not coherent across SMs)
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                ss = tl.zeros([BLOCK_M], tl.float32)
                for s in range(SPLIT):
                    if HAS_NORM:
                        ss += tl.load(ss_base + s * ss_stride + rows, cache_modifier=".cg")
                    part = PART + s * (2 if SWIGLU else 1) * stride
                    acc += tl.load(part + tile, mask=col_ok[:, None], other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(part + stride + tile, mask=col_ok[:, None], other=0.0,
                                          cache_modifier=".cg")
                tl.atomic_xchg(COUNT + pid_n, 0)  # ready for the next launch
        if last:
            if HAS_SUMS:  # a folded norm: the rows' sums of squares came in parts from the GEMM that wrote x
                ss = ss_in
            if HAS_NORM or HAS_SUMS:  # RMSNorm's scale is a factor of each row's sums: (x * r) W = r (x W)
                rstd = 1.0 / tl.sqrt(ss / k_dim + eps)
                acc = acc * rstd[None, :]
                acc_up = acc_up * rstd[None, :]
            if SWIGLU:
                acc = acc * tl.sigmoid(acc) * acc_up
            out_ok = col_ok[:, None] & row_ok[None, :]
            if HAS_RES:  # the residual stream's add, in float32 with one rounding
                acc += tl.load(R + rows[None, :] * sr_m + cols[:, None], mask=out_ok, other=0.0).to(tl.float32)
            o_ptrs = OUT + rows[None, :] * so_m + cols[:, None]
            y = acc.to(OUT.dtype.element_ty)
            tl.store(o_ptrs, y, mask=out_ok)
            if RETURN_SUMS:  # this column block's part of each row's sum of squares, of the values stored
                yf = tl.where(out_ok, y.to(tl.float32), 0.0)
                tl.store(SUMS_OUT + pid_n * n_rows + rows, tl.sum(yf * yf, 0), mask=row_ok)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False, tiles: Tiles | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  residual: torch.Tensor | None = None, norm_sums: torch.Tensor | None = None,
                  return_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x[rows, K] or [bs, rows, K] (at most MAX_ROWS rows) @ weight[N, K].T -> [..., N] (or [..., N/2] with swiglu, weight =
    [gate; up]), in x's dtype, through the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1).
    norm_weight: RMSNorm each row of x first (a decoder layer's input or post-attention norm); residual:
    added to the result (the residual stream, [..., N]). `tiles` overrides choose_tiles (tuning runs).
    norm_sums[parts, rows] float32: a folded RMSNorm (the norm's weight already multiplied into `weight`'s
    columns, ddtree.models.target.Target.fold_norms): the sums, added over parts, are each row's sum of
    squares of x, and only the 1 / rms scale is applied. return_sums: also return the output rows' sums of
    squares as [column blocks, rows] float32 (the next folded norm's norm_sums)."""
    if triton is None:
        raise RuntimeError("skinny_linear: triton is not installed (pip install 'triton>=3.0')")
    k, n_out = check_inputs(x, weight, norm_weight, residual, swiglu, who="skinny_linear")
    check_sums(x, norm_weight, norm_sums, return_sums, swiglu, who="skinny_linear")
    n_rows = x[..., 0].numel()
    if n_rows > MAX_ROWS:
        raise ValueError(f"skinny_linear: at most {MAX_ROWS} rows, got {n_rows} (larger products are cuBLAS's)")
    out = x.new_empty(*x.shape[:-1], n_out)
    tiles = tiles or choose_tiles(n_rows, k, n_out, swiglu, x.device, x.element_size())
    blocks = -(-n_out // tiles.block_n)
    sums = x.new_empty(blocks, n_rows, dtype=torch.float32) if return_sums else None  # every entry is stored
    if n_rows == 0 or n_out == 0:
        return (out, sums) if sums is not None else out
    x2 = x.reshape(n_rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("skinny_linear: the weight's rows must be contiguous (stride 1 along K)")
    r2 = out.view(n_rows, n_out) if residual is None else residual.reshape(n_rows, n_out)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    block_m = max(16, triton.next_power_of_2(n_rows))
    sums_in = norm_sums.contiguous() if norm_sums is not None else None
    # each split covers a whole number of BLOCK_K loads (the last may cover fewer); none is empty
    k_split = triton.cdiv(triton.cdiv(k, tiles.split), tiles.block_k) * tiles.block_k
    split = triton.cdiv(k, k_split)
    partial_elems = split * ((2 if swiglu else 1) * n_out + blocks) * block_m if split > 1 else 0
    count, part = WORKSPACE.get(x.device, partial_elems)
    if blocks > count.numel():
        raise ValueError(f"skinny_linear: {blocks} column blocks exceed the {count.numel()} counters; "
                         f"use a larger Tiles.block_n")
    even = k % tiles.block_k == 0
    n_parts = 1 if sums_in is None else sums_in.shape[0]
    _skinny_kernel[(blocks, split)](
        x2, weight, norm_weight if norm_weight is not None else weight, r2, out.view(n_rows, n_out), part, count,
        sums_in if sums_in is not None else part, sums if sums is not None else part,
        n_rows, n_out, k, k_split, eps, x2.stride(0), weight.stride(0), r2.stride(0), n_out, n_parts,
        SPLIT=split, SWIGLU=swiglu, HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
        UPCAST=x.dtype == torch.float32 or not x.is_cuda, EVEN=even,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        HAS_SUMS=sums_in is not None, RETURN_SUMS=sums is not None, SUM_PARTS=triton.next_power_of_2(n_parts),
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return (out, sums) if sums is not None else out
