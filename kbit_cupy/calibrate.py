"""Calibrated quantization: indices and scales chosen against the layer's inputs.

The format does not change (FORMAT.md sections 3-6): every result here is a
``KbitWeight`` of bit-plane indices, E4M4 (or fp16) block scales and a
codebook, so every kernel, save/load and the MoE path read it unchanged. What
changes is how the indices and scales are chosen: instead of rounding each
weight to its nearest entry (RTN), ``gptq_quantize`` minimises the error of
the layer's *output* on calibration inputs ``X``,

    ||X (W - Q)^T||^2 = trace((W - Q) H (W - Q)^T),   H = X^T X,

the "H-weighted error" (``hessian_error``). It is GPTQ (Frantar et al., 2022)
fitted to this format:

- Columns of ``K_dim`` are quantized in order. At the first column of each
  32-column block the block's scale is fixed from the *error-updated* values
  (their absmax, encoded and decoded as section 3 says), then each column's
  index is the section-4 nearest entry of ``value / scale``. So the indices
  are exactly what ``quantize_kbit``'s rule picks for the dequantized weight
  with these scales: re-encoding gives the same bits.
- Each column's rounding error is propagated to the columns after it through
  the upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``): within a
  32-column block at once, to the rest of a batch of ``block_columns``
  columns with one matrix product per block, and to everything after the
  batch with one product per batch (the lazy batched updates that keep the
  GPU busy). ``U`` comes from one Cholesky factorisation of the reversed
  ``H`` and one triangular inverse (``_inverse_cholesky``).
- The per-column work inside a 32-column block (scale, index, error, the
  update of the block's later columns, for every candidate scale) is one
  CUDA kernel launch per block on the GPU (``_KERNEL_SOURCE``, one thread
  per row, the values in registers), and a few whole-array NumPy operations
  per column on the host (``_HostBlocks``, the oracle: both give the same
  bits for the same block input). So the GPU path issues about 0.1 device
  operations per column (a launch, a product and a subtraction per block),
  where the column-by-column array code needed about 25.

On top of plain GPTQ, each measured in ``benchmarks/gptq_quality.py``:

- ``scale_search``: each block also tries scales below its absmax (a grid
  down to ``scale_floor`` times it, each encoded to a storable scale) and
  keeps, per block, the one with the smallest H-weighted error of its 32
  columns (the GPTQ loss ``sum(err**2)`` of those columns).
- ``fit_codebook``: the codebook is refitted to what GPTQ actually rounds
  (the error-updated quotients ``value / scale``, each weighted by its cost
  ``scale**2 / U_jj**2``, a weighted Lloyd step on ``fit_codebook``'s
  histogram), then GPTQ runs again with it; the best pass is kept.
- ``guard_rtn`` (on by default): the result is never worse than RTN with the
  same codebook on the H-weighted error; where it would be, RTN is returned.
- Mixed bit widths: ``allocate_bits`` picks ``k`` per layer under an average
  bits-per-weight budget from measured errors; ``quantize_mixed`` measures
  them (GPTQ at every ``k``) and returns the weights with the allocation.
  Per-layer errors add up only roughly to the model's loss, so
  ``search_allocation`` measures whole allocations with a caller's loss (the
  MiniLM example: its embeddings on calibration sentences) and moves layers
  up and down from the better of uniform ``k`` and the predicted allocation.

Sequential calibration (each layer's ``H`` from inputs produced by the
already-quantized layers before it) belongs to the model's forward pass;
``examples/minilm.py`` shows it with ``HessianAccumulator``.

NumPy and CuPy arrays both work (the result lives where ``W`` lives). Both are
deterministic, but they do not give the same bits: the error propagation is a
long chain of float32 matrix products whose summation order differs between
BLAS and cuBLAS, and one rounding difference in an error-updated value can
move an index, whose error then propagates. Each path is bit-reproducible on
its own machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ._arrays import array_module, as_module_array, to_host
from .codebook import _Histogram
from .codebook import fit_codebook as _fit_codebook_rtn
from .format import (
    BLOCK,
    E4M4_LIMIT,
    FLT_MIN,
    FP16_LIMIT,
    check_codebook,
    check_k,
    create_normal_float_codebook,
    scales_from_absmax,
    select_indices,
)
from .gemm import KbitWeight, _indices_to_planes
from .quantize import _check_absmax_format, _plan_for, quantize_kbit

SCALE_BITS = {"e4m4": 8, "fp16": 16}  # stored bits per block scale
DEFAULT_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean
DEFAULT_SEARCH = 8  # candidate scales per block with scale_search=True
DEFAULT_SCALE_FLOOR = 0.7  # smallest candidate scale, as a fraction of the absmax
DEFAULT_FIT_ROUNDS = 2  # codebook refits with fit_codebook=True
_FIT_BINS = 1 << 14  # histogram bins of the codebook refit


# --------------------------------------------------------------------------
# calibration statistics


class HessianAccumulator:
    """Running ``H = X^T X`` of one linear layer's inputs, batch by batch.

    ``HessianAccumulator(in_features, dtype=numpy.float64, xp=numpy)`` starts
    from zeros; ``add(x, mask)`` adds the rows of ``x`` (shape ``[..., in_features]``,
    any float dtype, in ``xp``) whose ``mask`` entry (shape ``x.shape[:-1]``,
    bool or 0/1) is set: padding tokens are left out. ``hessian`` is the sum
    divided by the number of rows added (the mean second moment, so that
    statistics from different numbers of tokens compare); ``total`` the sum;
    ``count`` the rows. ``dtype`` is float32 or float64 (the accumulation
    and the result).

    Raises ValueError for a wrong ``in_features``/shape/mask shape and
    TypeError for a non-float ``dtype``.
    """

    def __init__(self, in_features: int, dtype=np.float64, xp=np):
        if isinstance(in_features, bool) or not isinstance(in_features, (int, np.integer)) \
                or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        self.in_features = int(in_features)
        self.dtype = dtype
        self.xp = xp
        self.total = xp.zeros((self.in_features, self.in_features), dtype=dtype)
        self.count = 0

    def add(self, x, mask=None) -> None:
        """Add the rows of ``x`` (``[..., in_features]``) where ``mask`` is set."""
        xp = self.xp
        if array_module(x) is not xp:
            raise TypeError("x must live where the accumulator does (NumPy or CuPy); "
                            "pass xp= to HessianAccumulator or move x")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dimension must be in_features={self.in_features}, "
                             f"got shape {x.shape}")
        rows = x.reshape(-1, self.in_features)
        if mask is not None:
            mask = xp.asarray(mask)
            if mask.shape != x.shape[:-1]:
                raise ValueError(f"mask must have shape x.shape[:-1] = {x.shape[:-1]}, "
                                 f"got {mask.shape}")
            rows = rows[mask.reshape(-1) != 0]
        if rows.shape[0] == 0:
            return
        rows = rows.astype(self.dtype)
        self.total += rows.T @ rows
        self.count += int(rows.shape[0])

    @property
    def hessian(self):
        """``total / count`` (zeros before anything was added), in ``xp`` and ``dtype``."""
        return self.total / max(self.count, 1)


# --------------------------------------------------------------------------
# errors


def hessian_error(W, W_hat, hessian) -> float:
    """``trace((W - W_hat) H (W - W_hat)^T)`` in float64: the output error of the
    quantized layer on the calibration inputs (per token when ``H`` is a mean).

    ``W``: ``[N, K_dim]`` array; ``W_hat``: the same shape, or a ``KbitWeight``
    (dequantized in float32); ``hessian``: ``[K_dim, K_dim]`` or a
    ``HessianAccumulator``. All in one module.
    """
    if isinstance(W_hat, KbitWeight):
        W_hat = W_hat.dequantize(np.float32)
    if isinstance(hessian, HessianAccumulator):
        hessian = hessian.hessian
    xp = array_module(W)
    diff = W.astype(xp.float64) - W_hat.astype(xp.float64)
    return float(((diff @ hessian.astype(xp.float64)) * diff).sum())


# --------------------------------------------------------------------------
# GPTQ


@dataclass
class GPTQReport:
    """What ``gptq_quantize`` did: H-weighted errors and which result it kept.

    ``error`` of the returned weight, ``rtn_error`` of RTN with the starting
    codebook, ``passes`` the error of each GPTQ pass (one per codebook),
    ``chosen`` ``"gptq"`` or ``"rtn"``, ``damp`` the relative damping used.
    """

    error: float
    rtn_error: float
    passes: list[float] = field(default_factory=list)
    chosen: str = "gptq"
    damp: float = DEFAULT_DAMP


def gptq_quantize(
    W,
    k: int = 4,
    codebook=None,
    *,
    hessian,
    absmax_format: str = "e4m4",
    damp: float = DEFAULT_DAMP,
    block_columns: int = 128,
    scale_search: bool | int = False,
    scale_floor: float = DEFAULT_SCALE_FLOOR,
    fit_codebook: bool | int = False,
    guard_rtn: bool = True,
    return_report: bool = False,
):
    """Quantize ``W`` with GPTQ error compensation into the kbit format.

    Parameters
    ----------
    W : ``[N, K_dim]`` float16 / bfloat16 / float32 / float64 array (NumPy or
        CuPy), ``K_dim % 32 == 0``, finite.
    k : bits per index, 2..5.
    codebook : ``2**k`` floats, None (the NF codebook) or ``"fit"``
        (``fit_codebook(W, k)``, fitted for RTN) as the starting codebook.
    hessian : ``[K_dim, K_dim]`` symmetric positive semi-definite array (or a
        ``HessianAccumulator``) in ``W``'s module: ``X^T X`` of the layer's
        inputs (any positive multiple of it).
    absmax_format : ``"e4m4"`` (default) or ``"fp16"`` block scales.
    damp : ``damp * mean(diag H)`` is added to ``H``'s diagonal before it is
        inverted (doubled until the Cholesky factorisation succeeds).
    block_columns : columns per lazy batch, a multiple of 32.
    scale_search : False, True (``DEFAULT_SEARCH`` candidates) or the number
        of candidate scales per block, from the absmax down to
        ``scale_floor`` times it; each block keeps the candidate with the
        smallest GPTQ loss over its 32 columns (ties: the larger scale).
    fit_codebook : False, True (``DEFAULT_FIT_ROUNDS``) or the number of
        rounds of refitting the codebook to the GPTQ pass and running it
        again; the pass with the smallest H-weighted error is kept.
    guard_rtn : return RTN (``quantize_kbit`` with the starting codebook)
        where it has the smaller H-weighted error.
    return_report : also return a ``GPTQReport``.

    Returns
    -------
    ``KbitWeight`` in ``W``'s module (and a ``GPTQReport`` with
    ``return_report``). Deterministic for a given input and machine.

    Raises
    ------
    ValueError: bad ``k``/shapes/options, non-finite input, a scale too
    large for the format. TypeError: arrays from different modules, bad dtypes.
    """
    k = check_k(k)
    absmax_format = _check_absmax_format(absmax_format)
    xp, W = as_module_array(W, "W")
    if W.dtype.kind != "f" and W.dtype.name != "bfloat16":
        raise TypeError(f"W must be a float array, got dtype {W.dtype}")
    if W.ndim != 2 or W.shape[1] % BLOCK or W.shape[0] < 1 or W.shape[1] < BLOCK:
        raise ValueError(f"W must be 2-D [N, K_dim] with K_dim a positive multiple of {BLOCK}, "
                         f"got shape {W.shape}")
    N, K_dim = (int(d) for d in W.shape)
    W32 = xp.ascontiguousarray(W.astype(xp.float32))
    if not bool(xp.isfinite(W32).all()):
        raise ValueError("W contains NaN or infinity; quantization needs finite values")
    H = _check_hessian(xp, hessian, K_dim)
    if isinstance(block_columns, bool) or not isinstance(block_columns, (int, np.integer)) \
            or block_columns < BLOCK or block_columns % BLOCK:
        raise ValueError(f"block_columns must be a positive multiple of {BLOCK}, "
                         f"got {block_columns!r}")
    candidates = _count_option(scale_search, DEFAULT_SEARCH, "scale_search")
    rounds = _count_option(fit_codebook, DEFAULT_FIT_ROUNDS, "fit_codebook")
    if not 0.0 < float(scale_floor) <= 1.0:
        raise ValueError(f"scale_floor must be in (0, 1], got {scale_floor!r}")
    factors = np.linspace(1.0, float(scale_floor), candidates + 1) if candidates else np.ones(1)

    if isinstance(codebook, str):
        if codebook != "fit":
            raise ValueError(f'codebook must be an array, None or "fit", got {codebook!r}')
        start = _fit_codebook_rtn(W32, k, absmax_format=absmax_format)
    elif codebook is None:
        start = create_normal_float_codebook(k)
    else:
        start = check_codebook(to_host(codebook), k)

    U, used_damp = _inverse_cholesky(xp, H, float(damp))
    best = None
    passes = []
    cb = start
    for round_ in range(rounds + 1):
        idx, stored, targets = _gptq_pass(xp, W32, U, cb, k, absmax_format, factors,
                                          int(block_columns), record=round_ < rounds)
        weight = _to_weight(xp, idx, stored, cb, k, N, K_dim)
        error = hessian_error(W32, weight, H)
        passes.append(error)
        if best is None or error < best[1]:
            best = (weight, error)
        if round_ < rounds:
            cb = _refit_codebook(cb, *targets)
    weight, error = best
    rtn = _to_rtn_weight(xp, W32, k, start, absmax_format, N, K_dim)
    rtn_error = hessian_error(W32, rtn, H)
    chosen = "gptq"
    if guard_rtn and rtn_error < error:
        weight, error, chosen = rtn, rtn_error, "rtn"
    if return_report:
        return weight, GPTQReport(error, rtn_error, passes, chosen, used_damp)
    return weight


def _count_option(value, default: int, name: str) -> int:
    if value is True:
        return default
    if value is False or value is None:
        return 0
    if isinstance(value, (int, np.integer)) and value >= 0:
        return int(value)
    raise ValueError(f"{name} must be a bool or a non-negative int, got {value!r}")


def _check_hessian(xp, hessian, K_dim: int):
    if isinstance(hessian, HessianAccumulator):
        hessian = hessian.hessian
    if hessian is None:
        raise ValueError("gptq_quantize needs hessian= (X^T X of the layer's inputs, "
                         "e.g. from HessianAccumulator)")
    if array_module(hessian) is not xp:
        raise TypeError("hessian must live where W does (both NumPy or both CuPy)")
    H = xp.asarray(hessian)
    if H.shape != (K_dim, K_dim):
        raise ValueError(f"hessian must have shape [K_dim, K_dim] = [{K_dim}, {K_dim}], "
                         f"got {H.shape}")
    H = H.astype(xp.float64)
    if not bool(xp.isfinite(H).all()):
        raise ValueError("hessian contains NaN or infinity")
    return H


def _inverse_cholesky(xp, H, damp: float):
    """Upper-triangular float32 ``U`` with ``(H + damping)^-1 = U^T U``, and the damping used.

    With ``J`` the reversal permutation and ``J H J = L L^T`` (Cholesky),
    ``H = R R^T`` for the upper ``R = J L J``, so ``H^-1 = R^-T R^-1`` and
    ``U = R^-1 = J L^-1 J``: one Cholesky and one triangular inverse (about
    ``K_dim**3`` flops, 4-5x fewer than inverting ``H`` and factorising again).
    Inputs never seen (a zero diagonal entry) get a diagonal of 1: their
    columns are rounded with no error propagated to or from them.
    """
    H = H.copy()
    diag = xp.diagonal(H).copy()
    dead = diag <= 0
    H[:, dead] = 0
    H[dead, :] = 0
    diag = xp.where(dead, 1.0, diag)
    mean = float(diag[~dead].mean()) if bool((~dead).any()) else 1.0
    eye = xp.arange(H.shape[0])
    for _ in range(12):
        trial = H.copy()
        trial[eye, eye] = diag + damp * mean
        try:
            lower = xp.linalg.cholesky(xp.ascontiguousarray(trial[::-1, ::-1]))
            upper = _lower_inverse(xp, lower)[::-1, ::-1]
        except np.linalg.LinAlgError:
            damp = damp * 2 if damp > 0 else 1e-6
            continue
        if bool(xp.isfinite(upper).all()):  # CuPy reports failure as NaN, not an exception
            return xp.ascontiguousarray(upper.astype(xp.float32)), damp
        damp = damp * 2 if damp > 0 else 1e-6
    raise ValueError("hessian is not positive definite even with damping; "
                     "check the calibration statistics")


_LEAF = 256  # triangular inverse: blocks up to this size go to linalg.inv


def _lower_inverse(xp, L):
    """``L^-1`` of a lower-triangular matrix by halves: ``[[A, 0], [C, D]]^-1 =
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]]`` (matrix products, about ``2 n**3 / 3`` flops)."""
    n = L.shape[0]
    if n <= _LEAF:
        return xp.tril(xp.linalg.inv(L))
    h = n // 2
    a = _lower_inverse(xp, L[:h, :h])
    d = _lower_inverse(xp, L[h:, h:])
    out = xp.zeros_like(L)
    out[:h, :h] = a
    out[h:, h:] = d
    out[h:, :h] = -(d @ (L[h:, :h] @ a))
    return out


def _flush(x):
    """float32 denormals to signed zero (FORMAT.md: GPU arithmetic is flush-to-zero)."""
    return np.where(np.abs(x) < FLT_MIN, np.copysign(np.float32(0), x), x)


class _HostBlocks:
    """The GPTQ step of one 32-column block on the host: the oracle of ``_DeviceBlocks``.

    For every row of ``W`` and every candidate scale (``factors`` times the
    block's absmax, encoded as FORMAT.md section 3 says): the 32 columns in
    order, each one's index the section-4 nearest entry of ``value / scale``,
    its error ``(value - q) / U_jj`` propagated to the block's later columns
    through ``U``'s rows (one float32 product and one float32 subtraction per
    element, no fused multiply-add). Each row keeps the candidate with the
    smallest loss ``sum(err**2)`` (float64, summed over the columns in order;
    ties: the first, the largest scale). Arrays are laid out ``[column,
    candidate, row]`` so that each step is a few contiguous whole-array
    operations.
    """

    def __init__(self, plan, factors, absmax_format, U, inv_diag, record):
        self.plan, self.cb = plan, plan.codebook
        self.factors = factors.astype(np.float32)
        self.absmax_format, self.U, self.inv_diag, self.record = absmax_format, U, inv_diag, record

    def __call__(self, W, col0, errors, out):
        N = W.shape[0]
        values = _flush(W[:, col0:col0 + BLOCK])
        absmax = np.abs(values).max(axis=1)
        stored, scale = scales_from_absmax(self.factors[:, None] * absmax[None, :],
                                           self.absmax_format)  # [C, N]
        safe = np.where(scale > 0, scale, np.float32(np.inf))  # z = +-0 where the scale is 0
        C = scale.shape[0]
        trial = np.empty((BLOCK, C, N), np.float32)
        trial[:] = values.T[:, None, :]
        t_idx = np.empty((BLOCK, C, N), np.int64)
        t_err = np.empty((BLOCK, C, N), np.float32)
        t_z = np.empty((BLOCK, C, N), np.float32) if self.record else None
        u = self.U[col0:col0 + BLOCK, col0:col0 + BLOCK]
        inv = self.inv_diag[col0:col0 + BLOCK]
        for j in range(BLOCK):
            column = _flush(trial[j])
            z = _flush(column / safe)
            t_idx[j] = select_indices(z, self.plan)
            q = _flush(self.cb[t_idx[j]] * scale)
            t_err[j] = (column - q) * inv[j]
            if self.record:
                t_z[j] = z
            if j + 1 < BLOCK:
                trial[j + 1:] -= t_err[j][None] * u[j, j + 1:, None, None]
        rows = np.arange(N)
        pick = np.argmin((t_err.astype(np.float64) ** 2).sum(axis=0), axis=0) if C > 1 \
            else np.zeros(N, np.int64)
        idx_out, stored_out, z_out, w_out = out
        idx_out[:, col0:col0 + BLOCK] = t_idx[:, pick, rows].T
        stored_out[:, col0 // BLOCK] = stored[pick, rows]
        errors[:] = t_err[:, pick, rows].T
        if self.record:
            z_out[:, col0:col0 + BLOCK] = t_z[:, pick, rows].T
            chosen = scale[pick, rows]
            w_out[:, col0:col0 + BLOCK] = chosen[:, None] ** 2 * inv ** 2

    def finish(self):
        pass


# One CUDA thread per row of W runs _HostBlocks' step for a 32-column block:
# the 32 values in registers, every candidate scale's loss first (when there
# are several), then the chosen candidate again, writing its indices, scale,
# errors (and the quotients and weights for the codebook refit). Scale
# encoding is common.cuh's (FORMAT.md section 3); a scale at or above `limit`
# is recorded in `overflow` (its float bits, atomicMax) and turned into the
# format's ValueError after the pass. Arithmetic is float32 with the _rn
# intrinsics (no contraction into FMA), flush-to-zero as CuPy compiles.
_KERNEL_SOURCE = r"""
#include "common.cuh"

namespace kbit {

__device__ __forceinline__ unsigned gptq_select(float z, const float* cb, int entries,
                                                const float* thr, const int* order, int n_thr,
                                                int fast) {
  if (fast) {  // FORMAT.md section 4 through format.py's thresholds: order[#(thr <= z)]
    int count = 0;
    for (int t = 0; t < n_thr; ++t) count += thr[t] <= z;
    return (unsigned)order[count];
  }
  float best = __int_as_float(0x7f800000);
  unsigned idx = 0;
  for (int j = 0; j < entries; ++j) {
    const float d = fabsf(__fsub_rn(z, cb[j]));
    if (d < best) { best = d; idx = (unsigned)j; }
  }
  return idx;
}

struct GptqShared {
  float u[kBlock][kBlock + 1];
  float inv[kBlock], cb[kBlock], thr[kBlock];
  int order[kBlock];
};

// One candidate over the block's 32 columns; returns sum(err^2) in float64.
template <bool kWrite>
__device__ __forceinline__ double gptq_run(const float (&v0)[kBlock], float s, const GptqShared& sh,
                                           int entries, int n_thr, int fast,
                                           unsigned char* idx_out, float* err_out, float* z_out,
                                           float* w_out) {
  float v[kBlock];
#pragma unroll
  for (int j = 0; j < kBlock; ++j) v[j] = v0[j];
  double loss = 0.0;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    const float col = v[j];
    const float z = s > 0.f ? __fdiv_rn(col, s) : 0.f;
    const unsigned idx = gptq_select(z, sh.cb, entries, sh.thr, sh.order, n_thr, fast);
    const float q = __fmul_rn(sh.cb[idx], s);
    const float err = __fmul_rn(__fsub_rn(col, q), sh.inv[j]);
    if (kWrite) {
      idx_out[j] = (unsigned char)idx;
      err_out[j] = err;
      if (z_out) {
        z_out[j] = z;
        w_out[j] = __fmul_rn(__fmul_rn(s, s), __fmul_rn(sh.inv[j], sh.inv[j]));
      }
    } else {
      loss = __dadd_rn(loss, __dmul_rn((double)err, (double)err));
    }
#pragma unroll
    for (int l = j + 1; l < kBlock; ++l) v[l] = __fsub_rn(v[l], __fmul_rn(err, sh.u[j][l]));
  }
  return loss;
}

__device__ __forceinline__ float gptq_scale(float factor, float absmax, int fp16, float limit,
                                            unsigned* overflow, unsigned* code) {
  const float trial = __fmul_rn(factor, absmax);
  if (trial >= limit) atomicMax(overflow, __float_as_uint(trial));
  if (fp16) {
    const __half h = __float2half_rn(trial);
    *code = (unsigned)__half_as_ushort(h);
    return __half2float(h);
  }
  *code = trial >= limit ? 0xffu : e4m4_encode(trial);
  return e4m4_decode(*code);
}

}  // namespace kbit

extern "C" __global__ void __launch_bounds__(64) kbit_gptq_block(
    const float* __restrict__ W, long long ldw, int rows, int col0,
    const float* __restrict__ U, const float* __restrict__ inv_diag,
    const float* __restrict__ factors, int candidates, float limit, int fp16,
    const float* __restrict__ codebook, int entries, const float* __restrict__ thresholds,
    const int* __restrict__ order, int n_thr, int fast,
    unsigned char* __restrict__ idx_out, void* __restrict__ stored_out, long long ld_stored,
    float* __restrict__ err_out, float* __restrict__ z_out, float* __restrict__ w_out,
    int record, unsigned* __restrict__ overflow) {
  using namespace kbit;
  __shared__ GptqShared sh;
  for (int i = threadIdx.x; i < kBlock * kBlock; i += blockDim.x)
    sh.u[i / kBlock][i % kBlock] = U[(col0 + i / kBlock) * ldw + col0 + i % kBlock];
  for (int i = threadIdx.x; i < kBlock; i += blockDim.x) {
    sh.inv[i] = inv_diag[col0 + i];
    sh.cb[i] = i < entries ? codebook[i] : 0.f;
    sh.thr[i] = i < n_thr ? thresholds[i] : 0.f;
    sh.order[i] = i <= n_thr ? order[i] : 0;
  }
  __syncthreads();
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const float* src = W + row * ldw + col0;
  float v0[kBlock];
  float absmax = 0.f;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    const float x = src[j];
    v0[j] = fabsf(x) < 1.17549435e-38f ? copysignf(0.f, x) : x;
    absmax = fmaxf(absmax, fabsf(v0[j]));
  }
  unsigned code;
  int best = 0;
  if (candidates > 1) {
    double best_loss = 0.0;
    for (int c = 0; c < candidates; ++c) {
      const float s = gptq_scale(factors[c], absmax, fp16, limit, overflow, &code);
      const double loss = gptq_run<false>(v0, s, sh, entries, n_thr, fast, nullptr, nullptr,
                                          nullptr, nullptr);
      if (c == 0 || loss < best_loss) { best_loss = loss; best = c; }
    }
  }
  const float s = gptq_scale(factors[best], absmax, fp16, limit, overflow, &code);
  const long long at = row * ldw + col0;
  gptq_run<true>(v0, s, sh, entries, n_thr, fast, idx_out + at, err_out + row * kBlock,
                 record ? z_out + at : nullptr, record ? w_out + at : nullptr);
  if (fp16) reinterpret_cast<unsigned short*>(stored_out)[row * ld_stored + col0 / kBlock] = code;
  else reinterpret_cast<unsigned char*>(stored_out)[row * ld_stored + col0 / kBlock] = code;
}
"""
_KERNEL_NAME = "kbit_gptq_block"
_KERNEL_THREADS = 64  # __launch_bounds__ above: 64 rows per CTA spreads a 4096-row layer over 64 SMs
_kernels: dict = {}


def _gptq_kernel():
    """The compiled block kernel for the current device (cached)."""
    import cupy

    from ._jit import compile_options, render_source

    device = cupy.cuda.runtime.getDevice()
    kernel = _kernels.get(device)
    if kernel is None:
        module = cupy.RawModule(code=render_source("gptq", _KERNEL_SOURCE),
                                options=compile_options())
        kernel = _kernels[device] = module.get_function(_KERNEL_NAME)
    return kernel


class _DeviceBlocks:
    """``_HostBlocks``' step on the GPU: one kernel launch per 32-column block."""

    def __init__(self, cp, plan, factors, absmax_format, U, inv_diag, record):
        self.absmax_format = absmax_format
        self.kernel = _gptq_kernel()
        self.overflow = cp.zeros(1, cp.uint32)
        fast = bool(plan.fast)
        thresholds = plan.thresholds if fast else np.zeros(1, np.float32)
        f, cb, thr, order = (cp.asarray(a) for a in (
            factors.astype(np.float32), plan.codebook.astype(np.float32),
            np.ascontiguousarray(thresholds, np.float32), plan.order.astype(np.int32)))
        limit = FP16_LIMIT if absmax_format == "fp16" else E4M4_LIMIT
        self.head = (U, inv_diag, f, np.int32(f.size), np.float32(limit),
                     np.int32(absmax_format == "fp16"), cb, np.int32(cb.size), thr, order,
                     np.int32(thresholds.size if fast else 0), np.int32(fast))
        self.record, self.dummy = np.int32(record), f  # dummy: never written unless recording

    def __call__(self, W, col0, errors, out):
        """W: float32 ``[N, K_dim]`` (C order); errors: ``[N, 32]`` (C order); ``out``:
        ``(indices [N, K_dim], stored scales [N, K_dim / 32], z or None, w or None)``."""
        idx_out, stored_out, z_out, w_out = out
        rows = W.shape[0]
        self.kernel(((rows + _KERNEL_THREADS - 1) // _KERNEL_THREADS,), (_KERNEL_THREADS,), (
            W, np.int64(W.shape[1]), np.int32(rows), np.int32(col0), *self.head,
            idx_out, stored_out, np.int64(stored_out.shape[1]), errors,
            self.dummy if z_out is None else z_out, self.dummy if w_out is None else w_out,
            self.record, self.overflow))

    def finish(self):
        bits = int(to_host(self.overflow)[0])
        if bits:  # the format's own error for the largest scale seen
            scales_from_absmax(np.array([bits], np.uint32).view(np.float32), self.absmax_format)


def _gptq_pass(xp, W, U, codebook, k, absmax_format, factors, block_columns, record):
    """One GPTQ pass; returns (indices [N, K] uint8, stored scales [N, K/32], targets).

    ``targets`` (only with ``record``): the quotients ``value / scale`` each index
    was chosen for and their weights ``scale**2 / U_jj**2``, for the codebook refit.
    Per 32-column block: one block step (``_HostBlocks`` / ``_DeviceBlocks``),
    then one product that carries its errors to the rest of the batch; per
    batch of ``block_columns``: one product for everything after it.
    """
    N, K_dim = W.shape
    W = W.copy()
    plan = _plan_for(k, codebook.astype(np.float32).tobytes())
    inv_diag = (1.0 / xp.diagonal(U)).astype(xp.float32)
    idx_out = xp.empty((N, K_dim), xp.uint8)
    stored_out = xp.empty((N, K_dim // BLOCK), np.uint8 if absmax_format == "e4m4" else np.float16)
    z_out = xp.empty((N, K_dim), xp.float32) if record else None
    w_out = xp.empty((N, K_dim), xp.float32) if record else None
    out = (idx_out, stored_out, z_out, w_out)
    if xp is np:
        step = _HostBlocks(plan, factors, absmax_format, U, inv_diag, record)
    else:
        step = _DeviceBlocks(xp, plan, factors, absmax_format, U, inv_diag, record)
    errors = xp.empty((block_columns // BLOCK, N, BLOCK), xp.float32)  # per block: contiguous
    for b1 in range(0, K_dim, block_columns):
        b2 = min(b1 + block_columns, K_dim)
        for g, col0 in enumerate(range(b1, b2, BLOCK)):
            step(W, col0, errors[g], out)
            if col0 + BLOCK < b2:
                rest = W[:, col0 + BLOCK:b2]
                rest -= errors[g] @ U[col0:col0 + BLOCK, col0 + BLOCK:b2]
        if b2 < K_dim:
            width = (b2 - b1) // BLOCK
            batch = errors[:width].transpose(1, 0, 2).reshape(N, b2 - b1)
            rest = W[:, b2:]
            rest -= batch @ U[b1:b2, b2:]
    step.finish()
    return idx_out, stored_out, (z_out, w_out)


def _compare_device_blocks(N: int = 256, K_dim: int = 256, k: int = 4, *,
                           absmax_format: str = "e4m4", scale_search: int = 0,
                           record: bool = True, seed: int = 0) -> int:
    """Mismatching outputs of the CUDA block kernel against ``_HostBlocks`` (0 when bit-exact).

    A random layer (``W`` N(0, 0.05) ``[N, K_dim]``, ``H`` of correlated inputs);
    every 32-column block is stepped on the host and on the GPU from the same
    ``W`` and ``U``, and indices, scales, errors (and the refit's quotients and
    weights with ``record``) are compared bit for bit. Needs CuPy and a GPU.
    """
    import cupy as cp

    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((N, K_dim)) * 0.05).astype(np.float32)
    X = rng.standard_normal((2 * K_dim, K_dim)) @ (np.eye(K_dim) + 0.3 * rng.standard_normal(
        (K_dim, K_dim)) / np.sqrt(K_dim))
    U, _ = _inverse_cholesky(np, X.T @ X / X.shape[0], DEFAULT_DAMP)
    inv_diag = (1.0 / np.diagonal(U)).astype(np.float32)
    plan = _plan_for(k, create_normal_float_codebook(k).tobytes())
    factors = np.linspace(1.0, DEFAULT_SCALE_FLOOR, scale_search + 1) if scale_search \
        else np.ones(1)
    host = _HostBlocks(plan, factors, absmax_format, U, inv_diag, record)
    device = _DeviceBlocks(cp, plan, factors, absmax_format, cp.asarray(U), cp.asarray(inv_diag),
                           record)
    stored = np.uint8 if absmax_format == "e4m4" else np.float16

    def outputs(xp):
        refit = (xp.zeros((N, K_dim), xp.float32), xp.zeros((N, K_dim), xp.float32)) if record \
            else (None, None)
        return (xp.zeros((N, K_dim), xp.uint8), xp.zeros((N, K_dim // BLOCK), stored), *refit)

    out_h, out_d = outputs(np), outputs(cp)
    W_d = cp.asarray(W)
    mismatches = 0
    for col0 in range(0, K_dim, BLOCK):
        err_h, err_d = np.zeros((N, BLOCK), np.float32), cp.zeros((N, BLOCK), cp.float32)
        host(W, col0, err_h, out_h)
        device(W_d, col0, err_d, out_d)
        mismatches += int((err_h.view(np.uint32) != err_d.get().view(np.uint32)).sum())
    device.finish()
    for a, b in zip(out_h, out_d):
        if a is not None:
            mismatches += int((a.view(np.uint8) != b.get().view(np.uint8)).sum())
    return mismatches


def _to_weight(xp, idx, stored, codebook, k, N, K_dim) -> KbitWeight:
    packed = _indices_to_planes(xp, idx.reshape(-1, BLOCK), k)
    return KbitWeight(packed, xp.ascontiguousarray(stored.reshape(-1)), xp.asarray(codebook),
                      k, (N, K_dim))


def _to_rtn_weight(xp, W32, k, codebook, absmax_format, N, K_dim) -> KbitWeight:
    packed, absmax, cb = quantize_kbit(W32, k, codebook=codebook, absmax_format=absmax_format)
    return KbitWeight(packed, absmax, cb, k, (N, K_dim))


def _refit_codebook(codebook: np.ndarray, z, weight) -> np.ndarray:
    """Weighted Lloyd iteration on the quotients GPTQ rounded (host, deterministic)."""
    z = to_host(z).reshape(-1).astype(np.float64)
    w = to_host(weight).reshape(-1).astype(np.float64)
    keep = w > 0
    z, w = z[keep], w[keep]
    if z.size == 0:
        return codebook
    span = max(float(np.abs(z).max()), 1e-30)
    bins = np.clip(((z + span) * (_FIT_BINS / (2 * span))).astype(np.int64), 0, _FIT_BINS - 1)
    sums = [np.bincount(bins, weights=v, minlength=_FIT_BINS) for v in (w, w * z, w * z * z)]
    fitted = _Histogram(*sums).lloyd(codebook)
    return fitted.astype(np.float32)


# --------------------------------------------------------------------------
# mixed bit widths


def bits_per_weight(k: int, absmax_format: str = "e4m4") -> float:
    """Stored bits per weight at ``k``: the index plus the block scale's share."""
    return check_k(k) + SCALE_BITS[_check_absmax_format(absmax_format)] / BLOCK


def allocate_bits(
    errors: Mapping[str, Mapping[int, float]],
    sizes: Mapping[str, int],
    budget: float,
    absmax_format: str = "e4m4",
) -> dict[str, int]:
    """Pick ``k`` per layer: the smallest total error within an average bit budget.

    ``errors[name][k]``: a layer's measured error at each allowed ``k`` (for
    instance its relative H-weighted error); ``sizes[name]``: its weight
    count; ``budget``: the average stored bits per weight (``bits_per_weight``:
    4.25 is k = 4 with E4M4 scales). Solved by a Lagrangian sweep (each
    layer independently minimises ``error + lambda * bits``), then the
    leftover budget goes greedily to the best error reduction per bit.
    Deterministic (ties by name order). Returns ``{name: k}`` whose
    weighted average ``bits_per_weight`` is at most ``budget``.

    Raises ValueError when even the smallest ``k`` everywhere exceeds the budget.
    """
    names = sorted(errors)
    if set(names) != set(sizes):
        raise ValueError("errors and sizes must have the same layer names")
    total = float(sum(sizes[n] for n in names))
    limit = float(budget) * total
    options = {n: sorted(int(k) for k in errors[n]) for n in names}

    def cost(alloc):
        return sum(sizes[n] * bits_per_weight(alloc[n], absmax_format) for n in names)

    def pick(lam):
        return {n: min(options[n], key=lambda k, n=n: (errors[n][k] + lam * sizes[n]
                                                       * bits_per_weight(k, absmax_format), k))
                for n in names}

    smallest = {n: options[n][0] for n in names}
    if cost(smallest) > limit * (1 + 1e-12):
        raise ValueError(f"budget {budget} bits/weight is below the smallest allowed widths "
                         f"({cost(smallest) / total:.3f} bits/weight)")
    scale = max(max(errors[n][k] for k in options[n]) for n in names) / max(
        min(sizes.values()), 1)
    lo, hi = 0.0, max(scale, 1e-300)
    while cost(pick(hi)) > limit:  # a large enough lambda: smallest widths
        hi *= 2
    for _ in range(100):  # bisect on lambda: the cheapest-in-error allocation that fits
        mid = (lo + hi) / 2
        if cost(pick(mid)) <= limit:
            hi = mid
        else:
            lo = mid
    alloc = pick(hi)
    while True:  # spend what is left: best error drop per extra bit first
        spare = limit - cost(alloc)
        best = None
        for n in names:
            for k in options[n]:
                extra = sizes[n] * (bits_per_weight(k, absmax_format)
                                    - bits_per_weight(alloc[n], absmax_format))
                if 0 < extra <= spare * (1 + 1e-12):
                    gain = (errors[n][alloc[n]] - errors[n][k]) / extra
                    if gain > 0 and (best is None or gain > best[0]):
                        best = (gain, n, k)
        if best is None:
            return alloc
        alloc[best[1]] = best[2]


def search_allocation(
    errors: Mapping[str, Mapping[int, float]],
    sizes: Mapping[str, int],
    budget: float,
    evaluate,
    *,
    tries: int = 6,
    max_rounds: int = 12,
    absmax_format: str = "e4m4",
) -> tuple[dict[str, int], dict]:
    """Mixed widths chosen on a measured loss, never worse on it than one width for all.

    ``errors[name][k]``: each layer's own cost at ``k`` (for instance the
    model's output loss with only that layer quantized), used to propose
    moves; ``evaluate({name: k})``: the measured loss of a whole allocation
    (lower is better; for instance 1 - mean cosine of a model's embeddings on
    calibration data). Starts from the better of the widest uniform ``k``
    within ``budget`` and ``allocate_bits(errors, ...)``, then moves greedily:
    each round proposes, for every layer, one width up (paid for by lowering
    other layers one width each, least predicted cost per freed bit first)
    and one width down (the freed bits raising others, best predicted gain
    per bit first), ranks the proposals by their predicted change, measures
    the ``tries`` best, and keeps the best one if it lowers the loss. Stops
    when none does, or after ``max_rounds``. Deterministic for a
    deterministic ``evaluate``.

    Returns ``(allocation, report)``; ``report``: ``loss``, ``start`` (which
    start won), ``starts`` (their losses), ``moves`` (accepted, with the loss
    after each) and ``evaluations``.
    """
    names = sorted(errors)
    options = {n: sorted(int(k) for k in errors[n]) for n in names}
    limit = float(budget) * float(sum(sizes[n] for n in names)) * (1 + 1e-12)

    def bits(n, k):
        return sizes[n] * bits_per_weight(k, absmax_format)

    def cost(alloc):
        return sum(bits(n, alloc[n]) for n in names)

    def step(n, k, direction):
        i = options[n].index(k) + direction
        return options[n][i] if 0 <= i < len(options[n]) else None

    cache: dict = {}

    def measure(alloc):
        key = tuple(alloc[n] for n in names)
        if key not in cache:
            cache[key] = float(evaluate(dict(alloc)))
        return cache[key]

    starts = {}
    common = sorted(set.intersection(*(set(options[n]) for n in names)))
    fitting = [k for k in common if cost(dict.fromkeys(names, k)) <= limit]
    if fitting:
        starts[f"uniform k={fitting[-1]}"] = dict.fromkeys(names, fitting[-1])
    starts["predicted"] = allocate_bits(errors, sizes, budget, absmax_format)
    losses = {label: measure(alloc) for label, alloc in starts.items()}
    label = min(losses, key=lambda s: (losses[s], s))
    alloc, loss = dict(starts[label]), losses[label]

    def complete(trial, first, direction):
        """Pay for (or spend) the bits of ``first``'s move with one-width moves of others."""
        change = errors[first][trial[first]] - errors[first][alloc[first]]
        others = []
        for n in names:
            k = step(n, alloc[n], -direction)
            if n != first and k is not None:
                delta = errors[n][k] - errors[n][alloc[n]]
                others.append((delta / abs(bits(n, k) - bits(n, alloc[n])), n, k, delta))
        others.sort()  # paying: least damage per freed bit; spending: most gain per bit
        for _, n, k, delta in others:
            if direction > 0 and cost(trial) <= limit:
                break
            if direction < 0 and (delta >= 0 or cost({**trial, n: k}) > limit):
                continue
            trial[n] = k
            change += delta
        return change if cost(trial) <= limit else None

    moves = []
    for _ in range(max_rounds):
        proposals = []
        for n in names:
            for direction in (1, -1):
                k = step(n, alloc[n], direction)
                if k is None:
                    continue
                trial = {**alloc, n: k}
                change = complete(trial, n, direction)
                if change is not None and trial != alloc:
                    proposals.append((change, n, direction, trial))
        proposals.sort(key=lambda p: (p[0], p[1], p[2]))
        seen, best = set(), None
        for change, n, direction, trial in proposals:
            key = tuple(trial[m] for m in names)
            if key in seen:
                continue
            seen.add(key)
            measured = measure(trial)
            if best is None or measured < best[0]:
                best = (measured, trial, n, direction)
            if len(seen) >= tries:
                break
        if best is None or best[0] >= loss:
            break
        loss, alloc = best[0], best[1]
        moves.append({"layer": best[2], "direction": best[3], "loss": loss})
    report = {"loss": loss, "start": label, "starts": losses, "moves": moves,
              "evaluations": len(cache)}
    return alloc, report


def quantize_mixed(
    weights: Mapping[str, object],
    hessians: Mapping[str, object],
    budget: float,
    ks=(2, 3, 4, 5),
    *,
    codebooks: Mapping[int, object] | None = None,
    sensitivity: str = "relative",
    absmax_format: str = "e4m4",
    **gptq_options,
):
    """GPTQ every layer at every ``k`` in ``ks``, then keep ``allocate_bits``' choice.

    ``weights[name]``: ``[N, K_dim]`` arrays; ``hessians[name]``: their
    ``H`` (arrays or ``HessianAccumulator``); ``budget``: average stored bits
    per weight; ``codebooks[k]``: starting codebook per ``k`` (default NF);
    ``sensitivity``: ``"relative"`` (H-weighted error over
    ``trace(W H W^T)``, the layer's output noise-to-signal) or
    ``"absolute"`` (the H-weighted error itself); the rest goes to
    ``gptq_quantize``.

    Returns ``(quantized, report)``: ``{name: KbitWeight}`` and a dict with
    ``allocation`` ``{name: k}``, ``bits_per_weight`` (achieved average),
    ``budget`` and ``errors`` ``{name: {k: sensitivity}}``.
    """
    if sensitivity not in ("relative", "absolute"):
        raise ValueError(f'sensitivity must be "relative" or "absolute", got {sensitivity!r}')
    codebooks = codebooks or {}
    results, errors, sizes = {}, {}, {}
    for name, W in weights.items():
        H = hessians[name]
        H = H.hessian if isinstance(H, HessianAccumulator) else H
        xp = array_module(W)
        W32 = W.astype(xp.float32)
        signal = float(((W32.astype(xp.float64) @ H.astype(xp.float64)) * W32).sum())
        sizes[name] = int(W.size)
        errors[name], results[name] = {}, {}
        for k in ks:
            weight, rep = gptq_quantize(W, k, codebooks.get(k), hessian=H,
                                        absmax_format=absmax_format, return_report=True,
                                        **gptq_options)
            results[name][k] = weight
            errors[name][k] = rep.error / signal if sensitivity == "relative" and signal > 0 \
                else rep.error
    alloc = allocate_bits(errors, sizes, budget, absmax_format)
    achieved = sum(sizes[n] * bits_per_weight(alloc[n], absmax_format) for n in alloc) / sum(
        sizes.values())
    report = {"allocation": alloc, "bits_per_weight": achieved, "budget": float(budget),
              "errors": errors}
    return {n: results[n][alloc[n]] for n in weights}, report


__all__ = [
    "GPTQReport",
    "HessianAccumulator",
    "allocate_bits",
    "bits_per_weight",
    "gptq_quantize",
    "hessian_error",
    "quantize_mixed",
    "search_allocation",
]

