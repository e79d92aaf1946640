"""Mixture-of-experts: many quantized experts of one shape, multiplied in one launch.

``quantize_experts`` turns ``E`` weights of shape ``[N, K_dim]`` into one
``KbitExperts`` object (contiguous, one codebook); ``kbit_grouped_gemm``
multiplies rows of ``A`` that are already grouped by expert, all experts in
one kernel launch (``kernels_src/gemm_mma.cu``, the grouped launch: the work
of the experts that have rows is spread evenly over every SM, experts
without rows cost nothing, the problem count stays on the GPU);
``moe_linear`` takes a router's top-k choices, groups the tokens on the GPU
and returns results in token order. NumPy inputs run the NumPy path
(dequantize, float32 matmul per expert).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from . import _jit, _launch
from ._arrays import array_module, as_module_array, same_module, to_host
from .format import BLOCK, check_codebook, check_k
from .gemm import (
    _FAST_TBPS,
    _GEMM_ARG_TYPES,
    _LATENCY_ARG_TYPES,
    ACT_DTYPES,
    K_PER_TILE,
    KbitWeight,
    _check_shape,
    _counters,
    _device_tbps,
    _KbitArrays,
    _tile_counts,
    _workspace,
    check_activation_dtype,
    check_same_place,
    has_wgmma,
    latency_geometry,
    launch_ctas_per_sm,
    repack_for_gemm,
)
from .quantize import _attributes, _sm_count, dequantize_kbit, quantize_kbit

_WARPS = 4  # per CTA of the grouped launch (mma.sync, one row tile per warp)
# moe_route.cu's per-(warp, expert) slots: 44 KB, under the 48 KB a launch gets
# without opting in (the kernel's static shared memory comes on top)
_ROUTE_SHARED_INTS = 11 * 1024
# Up to this many (token, choice) pairs moe_linear routes inside the grouped
# launch (every CTA counts the pairs per expert and places the rows of the
# problems it works on: one pass over the pairs per problem, 8 bytes of
# shared memory per pair) instead of launching moe_route.cu first. H200, k=4
# fp16, kernel-only, 8192 against 4096 (results/moe_gap_probe_h200_route_cap_*_5b1175c.txt):
# moe_linear at 5120-8192 pairs 0.5-1.3% less time (128 experts of
# [2048, 768] and [1536, 2048] at T=1024, 512 of [512, 2048] at T=512), the
# same at 512 x T=800 (which form ran there was not checked); not taken for
# so little.
_FUSED_ROUTE_MAX_PAIRS = 4096


class _RoutedTablesDoNotFit(ValueError):
    """The grouped launch's preferred problem size does not fit the shared
    memory with the routed ids and order (moe_linear routes in its own launch)."""


def _check_device(name: str, arr) -> None:
    """A CuPy input must live on the current device (where the kernels run)."""
    dev = _launch.current_device()
    if arr.data.device_id != dev:
        raise ValueError(f"{name} is on GPU {arr.data.device_id}, not the current one "
                         f"({dev}); move it with cupy.asarray under the right cupy.cuda.Device")


@dataclass
class KbitExperts(_KbitArrays):
    """``E`` k-bit quantized expert weights of one shape ``[N, K_dim]``.

    ``packed`` (uint32, ``E * N * K_dim / 32 * k``) and ``absmax`` (uint8 E4M4
    codes or float16, ``E * N * K_dim / 32``) are the FORMAT.md encoding of
    the ``[E, N, K_dim]`` tensor, so expert ``e``'s blocks follow expert
    ``e - 1``'s; ``codebook`` (float32, ``2**k``) is shared. All three live
    in one module (NumPy or CuPy). The kernels' tiled copy is built on first
    use (or by ``prepare()``).
    """

    packed: object
    absmax: object
    codebook: object
    k: int
    shape: tuple[int, int, int]  # (E, N, K_dim)
    _tiles: tuple | None = field(default=None, repr=False)
    # grouped launches per (rows, dtype, routing form, stream), built on a first call
    _plans: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.k = check_k(self.k)
        E, N, K_dim = (int(d) for d in self.shape)
        if E < 1:
            raise ValueError(f"need at least one expert, got E={E}")
        _check_shape(self.k, N, K_dim)
        self.shape = (E, N, K_dim)
        xp, self.packed = as_module_array(self.packed, "packed")
        same_module(xp, {"absmax": self.absmax})
        nblocks = E * N * K_dim // BLOCK
        if self.packed.dtype != np.uint32 or self.packed.shape != (nblocks * self.k,):
            raise ValueError(f"packed must be uint32 of shape ({nblocks * self.k},) for {E} experts "
                             f"of [{N}, {K_dim}] at k={self.k}, got {self.packed.dtype} "
                             f"{self.packed.shape}")
        if self.absmax.dtype not in (np.uint8, np.float16) or self.absmax.shape != (nblocks,):
            raise ValueError(f"absmax must be uint8 (E4M4) or float16 of shape ({nblocks},), "
                             f"got {self.absmax.dtype} {self.absmax.shape}")
        self.codebook = xp.asarray(check_codebook(to_host(self.codebook), self.k))

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert's indices and scales take (what a launch reads per expert)."""
        return int(self.packed.nbytes + self.absmax.nbytes) // self.num_experts

    def expert(self, e: int) -> KbitWeight:
        """Expert ``e`` as a ``KbitWeight`` (views of this object's arrays)."""
        E, N, K_dim = self.shape
        if not 0 <= int(e) < E:
            raise IndexError(f"expert {e} out of range for {E} experts")
        blocks = N * K_dim // BLOCK
        b0 = int(e) * blocks
        return KbitWeight(self.packed[b0 * self.k:(b0 + blocks) * self.k],
                          self.absmax[b0:b0 + blocks], self.codebook, self.k, (N, K_dim))

    def dequantize(self, dtype=np.float16):
        """All experts as one ``[E, N, K_dim]`` array of ``dtype`` (FORMAT.md section 6)."""
        return dequantize_kbit(self.packed, self.absmax, self.codebook, self.k, self.shape,
                               dtype=dtype)

    def prepare(self) -> KbitExperts:
        """Build the kernels' tiled layout now: expert-major, each expert as
        ``repack_for_gemm`` lays out one weight."""
        if self._tiles is None:
            E, N, K_dim = self.shape
            xp = array_module(self.packed)
            if N % 16 == 0:  # row tiles never straddle experts: one repack of [E * N, K_dim]
                self._tiles = repack_for_gemm(self.packed, self.absmax, self.k, E * N, K_dim)
            else:
                parts = [repack_for_gemm(w.packed, w.absmax, self.k, N, K_dim)
                         for w in (self.expert(e) for e in range(E))]
                self._tiles = (xp.concatenate([t for t, _ in parts]),
                               xp.concatenate([s for _, s in parts]))
        return self

    def to_device(self) -> KbitExperts:
        """A copy on the current CUDA device (CuPy arrays)."""
        import cupy as cp

        return KbitExperts(cp.asarray(self.packed), cp.asarray(self.absmax),
                           cp.asarray(self.codebook), self.k, self.shape)


def quantize_experts(W, k: int = 4, codebook=None, absmax_format: str = "e4m4") -> KbitExperts:
    """Quantize ``E`` expert weights of one shape into one ``KbitExperts``.

    W : ``[E, N, K_dim]`` array, or a sequence of ``E`` arrays ``[N, K_dim]``
        (same shape, dtype and module; stacked into one contiguous tensor),
        float16 / bfloat16 / float32, NumPy or CuPy, ``K_dim % 32 == 0``.
    k, codebook, absmax_format : as in ``quantize_kbit``; one codebook for
        all experts (``fit_codebook(W, k)`` fits one to them).

    Returns a ``KbitExperts`` in ``W``'s module. Raises ValueError for bad
    shapes (not 3-D, ``K_dim % 32``, no experts, mismatched list entries) and
    what ``quantize_kbit`` raises.
    """
    if isinstance(W, (list, tuple)):
        if not W:
            raise ValueError("need at least one expert weight")
        parts = [as_module_array(w, f"W[{i}]") for i, w in enumerate(W)]
        xp = parts[0][0]
        shapes = {p.shape for _, p in parts}
        if len(shapes) != 1 or len({p.dtype for _, p in parts}) != 1:
            raise ValueError(f"expert weights must share one shape and dtype, got shapes "
                             f"{sorted(shapes)} and dtypes {sorted({str(p.dtype) for _, p in parts})}")
        same_module(xp, {f"W[{i}]": p for i, (_, p) in enumerate(parts)})
        W = xp.stack([p for _, p in parts])
    else:
        _, W = as_module_array(W, "W")
    if W.ndim != 3:
        raise ValueError(f"W must be [E, N, K_dim] (or a list of [N, K_dim]), got shape {W.shape}")
    E, N, K_dim = (int(d) for d in W.shape)
    if E < 1:
        raise ValueError("need at least one expert weight (E >= 1)")
    _check_shape(check_k(k), N, K_dim)
    packed, absmax, cb = quantize_kbit(W, k=k, codebook=codebook, absmax_format=absmax_format)
    return KbitExperts(packed, absmax, cb, int(k), (E, N, K_dim))


# --------------------------------------------------------------------------
# the grouped product


def _check_inputs(A, experts: KbitExperts):
    """(xp, A) after the dtype, shape and place checks shared by both entry points."""
    if not isinstance(experts, KbitExperts):
        raise TypeError(f"experts must be a KbitExperts (from quantize_experts), got "
                        f"{type(experts).__name__}")
    xp, A = as_module_array(A, "A")
    check_activation_dtype(A)
    K_dim = experts.shape[2]
    if A.ndim != 2 or A.shape[1] != K_dim:
        raise ValueError(f"A must be [T, K_dim={K_dim}], got shape {A.shape}")
    check_same_place(xp, A, experts.packed, "experts", "the experts are", "experts.to_device()")
    return xp, A


def _output(xp, out, shape: tuple, dtype):
    """``out`` checked, or a new array."""
    if out is None:
        return xp.empty(shape, dtype=dtype) if xp is np else _launch.empty(shape, dtype)
    if array_module(out) is not xp:
        raise TypeError("out must be in the same module as A")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out must have shape {shape} and dtype {dtype}, got {out.shape} {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if xp is not np:
        _check_device("out", out)
    return out


def _integer_array(xp, arr, name: str, other: str):
    """``arr`` as an integer array of ``xp`` on the current device (TypeError otherwise)."""
    if array_module(arr) is not xp:
        raise TypeError(f"{name} must be in the same module as {other} (NumPy or CuPy)")
    if type(arr) is not xp.ndarray:
        arr = xp.asarray(arr)
    if xp is not np:
        _check_device(name, arr)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32 preferred), got dtype {arr.dtype}")
    return arr


def _check_offsets(xp, offsets, E: int, T: int, validate: bool):
    offsets = _integer_array(xp, offsets, "group_offsets", "A")
    if offsets.shape != (E + 1,):
        raise ValueError(f"group_offsets must have E + 1 = {E + 1} entries, got shape "
                         f"{offsets.shape}")
    if validate:  # one small device-to-host copy on the GPU path
        host = to_host(offsets).astype(np.int64)
        if host[0] != 0 or host[-1] != T or np.any(np.diff(host) < 0):
            raise ValueError(
                f"group_offsets must rise from 0 to T={T} (expert e owns rows offsets[e] .. "
                f"offsets[e+1] - 1 of A), got {host.tolist() if E < 16 else host}"
            )
    if xp is np or (offsets.dtype == np.int32 and offsets.flags.c_contiguous):
        return xp.ascontiguousarray(offsets.astype(xp.int32, copy=False))
    # converted into a buffer kept per stream: a graph captured here reads it
    buf = _launch.stream_buffer("moe_group_offsets", 4 * (E + 1), _launch.current_stream_ptr())
    converted = buf.view(np.int32)[:E + 1]
    with _launch.relaxed():  # CuPy compiles the copy kernel on its first call
        converted[...] = offsets
    return converted


def kbit_grouped_gemm(A, experts: KbitExperts, group_offsets, out=None, validate: bool = True):
    """All experts' products in one launch: ``C[r] = A[r] @ dequant(W_e).T`` for the rows r of expert e.

    A : ``[T, K_dim]`` float16 or ``ml_dtypes.bfloat16``, NumPy or CuPy, rows
        grouped by expert: expert ``e`` owns rows ``group_offsets[e]`` ..
        ``group_offsets[e + 1] - 1``.
    experts : a ``KbitExperts`` of shape ``(E, N, K_dim)`` in A's place.
    group_offsets : integer array of ``E + 1`` offsets (int32 preferred), in
        A's module, rising from 0 to T. Experts without rows cost nothing.
    out : optional C-contiguous ``[T, N]`` array of A's dtype and module.
    validate : check ``group_offsets`` (on the GPU: one small device-to-host
        copy, a synchronisation). With ``validate=False`` nothing is checked
        and nothing outside A or C is touched (offsets are clamped to
        ``[0, T]`` on the device), but bad offsets give bad results: rows no
        expert owns are left unwritten; offsets that fall let experts share
        rows. With few rows (a launch of one CTA per row and 16-row tile) each
        row then gets one expert or none, even a row some expert claims; with
        more, shared rows' values depend on which writes last (not
        deterministic), and past min(E, T) + T / rows-per-problem problems the
        rest are dropped.

    Returns ``C`` ``[T, N]`` in A's dtype, accumulated in float32; the same
    inputs on the same GPU give the same bits on every call.

    Raises TypeError (dtypes, places, offsets not integers) and ValueError
    (shapes, offsets not rising from 0 to T, ``out``).
    """
    if not validate and _cupy_ndarray is not None and type(A) is _cupy_ndarray \
            and type(experts) is KbitExperts and type(group_offsets) is _cupy_ndarray \
            and group_offsets.shape == (experts.shape[0] + 1,):
        C = _fast_launch(experts, A, A.shape[0], False, 1, out,
                         (A.shape[0], experts.shape[1]), group_offsets)
        if C is not None:
            return C
    xp, A = _check_inputs(A, experts)
    E, N, _ = experts.shape
    T = A.shape[0]
    offsets = _check_offsets(xp, group_offsets, E, T, validate)
    C = _output(xp, out, (T, N), A.dtype)
    if T == 0:
        return C
    if xp is np:
        for e in range(E):
            r0, r1 = (min(max(int(o), 0), T) for o in offsets[e:e + 2])
            if r1 > r0:  # experts without rows are never dequantized
                w = experts.expert(e).dequantize(np.float32)
                C[r0:r1] = (A[r0:r1].astype(np.float32) @ w.T).astype(A.dtype)
        return C
    A = xp.ascontiguousarray(A)
    if A.data.ptr % 16:
        A = A.copy()
    _launch_grouped(A, experts, offsets, C)
    return C


def grouped_m_tiles(rows: int, experts: int, choices: tuple = _jit.GEMM_GROUPED_M_TILES,
                    spread: float = 1.5) -> int:
    """n8 tiles per problem (one of ``choices``), from the rows an expert gets
    if ``rows`` spread evenly.

    Routed rows are uneven (binomial around the mean), and an expert with
    more rows than a problem holds is split into problems that each read its
    weights again, so a problem holds ``spread`` times the mean plus two rows,
    up to the largest choice. mma.sync (spread 1.5): up to 32 rows: 64-row
    problems (8 n8 tiles, 168-178 registers) measured slower on the H100 than
    splitting the larger experts (128 experts of [1536, 2048], 4096 rows: 293
    us against 243 us). The Hopper path chooses with grouped_wg_m_tiles.
    """
    per_expert = rows / max(1, min(experts, rows))
    want = math.ceil(spread * per_expert + 2)
    return next((t for t in choices if 8 * t >= want), choices[-1])


# Relative time of one problem of the grouped Hopper launch per n8 tiles (16,
# 32, 48 and 64 rows), measured on the H100 at 5cfbac8 with every expert in one
# problem (benchmarks/moe_mtiles_ab.py, k=4 fp16, results/moe_mtiles_ab_h100_*):
# 16 rows 0.90 of 32 (128 x [1536, 2048] at 8 rows per expert: 104.2 against
# 115.7 us; 512 x [512, 2048] at 5: 132.4 against 147.0), 48 rows 1.09 and 64
# rows 1.31 (128 x [1536, 2048] at 8 and 16 rows per expert: 126.0 and 152.2
# against 115.7; 129.7 and 156.1 against 119.3).
# 128 rows (two warpgroups) 2.0: Mixtral's 8 x [28672, 4096] at 128 and 256
# rows per expert, 1.5 and 2.5 problems of 128 rows against 2.5 and 4.5 of 64:
# 697.6 against 762.0 us and 1331.0 against 1506.4 (results/
# moe_mtiles_ab_h100_dcaf825_m16.txt); 128 x [3072, 4096] at 32 rows, one
# problem each: 834.5 against 557.7. 144 rows 2.13 and 160 rows 2.22 (two
# stages): Mixtral at 96 rows per expert, one problem each, 567.0 and 587.7
# against 532.0 us for 128 rows (results/moe_mtiles_ab_h100_mixtral_651af31.txt).
_WG_PROBLEM_COST = {2: 0.90, 4: 1.0, 6: 1.09, 8: 1.31, 16: 2.0, 18: 2.13, 20: 2.22}


def grouped_wg_m_tiles(rows: int, experts: int,
                       choices: tuple = _jit.GEMM_GROUPED_WG_M_TILES) -> int:
    """n8 tiles per problem of the grouped Hopper launch (one of ``choices``):
    the fewest expected problems weighted by their cost (_WG_PROBLEM_COST).

    Only the mean rows per expert is known on the host (the offsets stay on
    the GPU), so an expert's rows X are taken as a uniform router spreads
    them: about Poisson, normal with variance = mean here. An expert of X rows
    runs ceil(X / problem rows) problems, each reading its weights again;
    E[ceil(X / c)] = sum over j >= 0 of P(X > j * c). H100, k=4 (results/
    moe_mtiles_ab_h100_*): at 32 rows per expert 48-row problems beat the
    former 64-row ones by 15-22% (128 x [1536, 2048] 163.3 -> 138.5 us,
    [2048, 768] 106.6 -> 85.0), at 10 rows 16-row ones beat 32-row ones by 8%
    (512 x [512, 2048] 153.1 -> 140.5 us).
    """
    mean = rows / max(1, min(experts, rows))
    sd = math.sqrt(max(mean, 1.0))

    def problems(cap: int) -> float:  # E[ceil(X / cap)], X ~ N(mean, sd^2), X >= 1
        total, j = 1.0, 1
        while j * cap < mean + 8 * sd:
            total += 0.5 * math.erfc((j * cap + 0.5 - mean) / (sd * math.sqrt(2.0)))
            j += 1
        return total

    costs = {t: problems(8 * t) * _WG_PROBLEM_COST.get(t, t / 4) for t in choices}
    return min(choices, key=lambda t: (costs[t], t))


def _launch_grouped(A, experts: KbitExperts, offsets, C, row_ids=None, ids_per_row: int = 1,
                    route_ids=None) -> bool:
    """One grouped launch. ``C`` is ``[R, N]``; without ``row_ids`` A has the same
    R rows, with it sorted row g is row ``row_ids[g]`` of C and
    ``row_ids[g] // ids_per_row`` of A (moe_linear). With ``route_ids`` (R int32
    expert ids) instead of ``offsets`` and ``row_ids``, every CTA groups the
    pairs itself (moe_linear with few pairs). Up to _latency_moe_max_ctas()
    (rows x row tiles) without ``row_ids`` the latency kernel runs, a CTA per
    (row, row tile). The launch is planned once per (rows, dtype, routing
    form, device, stream); a call sets its pointers. Returns False, launching
    nothing, where ``route_ids`` is given and the ids and order would not fit
    the shared memory beside the preferred problem size (route them first)."""
    stream = _launch.current_stream_ptr()
    key = (C.shape[0], A.dtype, route_ids is not None, ids_per_row, row_ids is not None,
           _launch.current_device(), stream,
           threading.get_ident())  # per thread: the argument block is shared state
    found = experts._plans.get(key)
    if found is None:
        with _launch.setup_scope():  # one-time work stays out of a graph being captured
            _launch.ensure_context()  # plans are per thread: bind this thread's context
            row_tiles = _tile_counts(experts.shape[1], experts.shape[2])[0]
            if (row_ids is None and (route_ids is not None or _GROUPED_LATENCY)
                    and C.shape[0] * row_tiles <= _latency_moe_max_ctas(*experts.shape[1:])):
                try:
                    found = _GroupedRun(_latency_moe_launch(experts, A.dtype, C.shape[0],
                                                            ids_per_row), _LATENCY_SLOTS)
                except ValueError:  # a row of A longer than its shared memory holds
                    found = None
            if found is None:
                try:
                    found = _GroupedRun(_grouped_launch(experts, A.dtype, C.shape[0],
                                                        route_ids is not None, ids_per_row, stream))
                except _RoutedTablesDoNotFit:
                    found = False  # (remembered: _fast_launch finds no plan and takes this path)
        experts._plans[key] = found
        _remember_cupy()
    if not found:
        return False
    found(A.data.ptr, C.data.ptr, _launch.device_pointer(offsets), _launch.device_pointer(row_ids),
          _launch.device_pointer(route_ids), stream)
    return True


# gemm_mma.cu's arguments A, C, group_offsets, row_ids, route_ids; the same
# of gemm_latency.cu (which takes no row_ids: it goes to a dummy)
_GROUPED_SLOTS = (3, 4, 15, 17, 19)
_LATENCY_SLOTS = (3, 4, 13, None, 9)


class _GroupedRun:
    """A planned grouped launch: the call sets its five pointers and launches."""

    __slots__ = ("_launch", "argv", "pdl", "prefix", "values")

    def __init__(self, launch, slots: tuple = _GROUPED_SLOTS):
        import ctypes

        self.prefix, self.argv = launch.prefix, launch.argv
        self.values = [launch.value(i) if i is not None else ctypes.c_void_p(0) for i in slots]
        self._launch = launch  # keeps the argument block (and the arrays it names) alive
        # both kernels begin with grid_dependency_sync: programmatic launch on sm_90
        self.pdl = _launch.PdlLaunch(launch) if _launch.pdl_supported() else None

    def __call__(self, a: int, c: int, offsets: int, row_ids: int, route_ids: int,
                 stream: int) -> None:
        v = self.values
        v[0].value, v[1].value, v[2].value, v[3].value, v[4].value = (a, c, offsets, row_ids,
                                                                      route_ids)
        if self.pdl is not None:
            self.pdl(stream)
        else:
            _launch_kernel(*self.prefix, stream, self.argv, 0)


_cupy_ndarray = None  # bound on the first GPU call: the fast paths' type test and entry points
_get_device = _get_current_stream = _launch_kernel = None
_I32 = np.dtype(np.int32)


def _remember_cupy() -> None:
    global _cupy_ndarray, _get_device, _get_current_stream, _launch_kernel
    cp = _launch.cupy()
    _cupy_ndarray, _get_device = cp.ndarray, cp.cuda.runtime.getDevice
    _get_current_stream, _launch_kernel = cp.cuda.get_current_stream, cp.cuda.driver.launchKernel


def _fast_launch(experts: KbitExperts, A, rows: int, routed: bool, ids_per_row: int, out,
                 out_shape: tuple, ids):
    """The planned grouped launch for CuPy inputs that need no conversion
    (``validate=False`` calls): A 2-D contiguous, 16-byte aligned fp16/bf16 of
    K_dim columns, ``ids`` (group offsets, or routed ids) contiguous int32,
    everything on the current device, ``out`` None or of the exact shape,
    dtype and layout. Returns C, or None when anything is not so or no plan
    exists yet (the checked path then runs, raises its errors, builds it)."""
    K_dim = experts.shape[2]
    dev = _get_device()
    shape, a_mem = A.shape, A.data
    dtype = A.dtype
    if (len(shape) != 2 or shape[1] != K_dim or shape[0] == 0 or a_mem.ptr & 15
            or A.strides != (K_dim * dtype.itemsize, dtype.itemsize)
            or (dtype != ACT_DTYPES[0] and dtype != ACT_DTYPES[1])
            or a_mem.device_id != dev or experts.packed.data.device_id != dev
            or type(ids) is not _cupy_ndarray or ids.dtype != _I32
            or not ids.flags.c_contiguous or ids.data.device_id != dev):
        return None
    stream = _get_current_stream()
    run = experts._plans.get((rows, dtype, routed, ids_per_row, False, dev, stream.ptr,
                              threading.get_ident()))
    if not run:  # none yet, or routed ids that route in their own launch (False)
        return None
    if out is None:
        C = _launch.empty(out_shape, dtype, math.prod(out_shape) * dtype.itemsize, stream)
    elif (type(out) is _cupy_ndarray and out.shape == out_shape and out.dtype == dtype
          and out.flags.c_contiguous and out.data.device_id == dev):
        C = out
    else:
        return None
    ids_ptr = ids.data.ptr
    if routed:
        run(a_mem.ptr, C.data.ptr, 0, 0, ids_ptr, stream.ptr)
    else:
        run(a_mem.ptr, C.data.ptr, ids_ptr, 0, 0, stream.ptr)
    return C


def _latency_moe_launch(experts: KbitExperts, dtype, pairs: int, ids_per_row: int):
    """gemm_latency.cu over ``pairs`` (token, expert) pairs, routed ids set per
    call: CTA (pair, row tile) multiplies the pair's row of A by its expert's
    row tile (no grouping, no scan: the kernel's "Mixture of experts"). For
    few pairs, where the grouped launch's scan and stream-K reduction cost
    more than reading an expert twice costs."""
    E, N, K_dim = experts.shape
    tiles, scales = experts.prepare()._tiles
    rt_n, kt_n = _tile_counts(N, K_dim)
    if pairs * rt_n >= 2**31:
        raise ValueError(f"too many pairs ({pairs}) for one launch; split the tokens")
    ksplit = _moe_latency_ksplit(experts.k, experts.absmax.dtype)
    kern = _jit.get_kernel("gemm_latency", experts.k, dtype.name, experts.absmax.dtype.name, 1,
                           *((False, False, ksplit) if ksplit != 1 else ()))
    warps, shared = latency_geometry(kern, 1, kt_n, dtype.itemsize, 1, pairs * rt_n, ksplit)
    return _launch.Launch(kern, (pairs * rt_n,), (32 * warps,), shared, _LATENCY_ARG_TYPES,
                          (tiles, scales, experts.codebook, 0, 0, pairs, N, K_dim, kt_n, 0,
                           ids_per_row, E, 0, 0, 1))


# The few-pair launch's units per K tile (gemm_latency.cu KSPLIT: 2, a warp
# takes half K tiles and a CTA up to twice the warps) at the bit widths of
# _jit.MOE_LATENCY_KSPLIT_KS, with E4M4 scales; 1 elsewhere (and for A/B runs).
# H200, k = 4 fp16, kernel-only, in one process against whole tiles
# (results/moe_gap_probe_h200_ksplit2_*): T = 1 on 128 x [1536, 2048] top-8
# moe_linear 10.91 -> 10.17 us, on 128 x [2048, 768] 8.23 -> 7.42, on
# 512 x [512, 2048] top-10 6.80 -> 6.92 (T = 2: 10.20 -> 9.24); the grouped
# call 0.91-1.01x. Dense layers keep whole tiles (0.75x at k = 3 to 1.10x at
# k = 4 by layer; define_ab_h200_ksplit_c48bd03.txt). Not measured on the
# H100: only a GPU of _MOE_LATENCY_KSPLIT_MIN_TBPS or more takes it.
_MOE_LATENCY_KSPLIT = 2
_MOE_LATENCY_KSPLIT_MIN_TBPS = _FAST_TBPS  # (4 TB/s: the H200's 4.8, not the H100's 3.35)


def _moe_latency_ksplit(k: int, scale_dtype) -> int:
    """KSPLIT of the few-pair launch (_MOE_LATENCY_KSPLIT where k is in
    _jit.MOE_LATENCY_KSPLIT_KS, the scales are E4M4 and the GPU's bandwidth is
    _MOE_LATENCY_KSPLIT_MIN_TBPS or more; else 1)."""
    if (k in _jit.MOE_LATENCY_KSPLIT_KS and np.dtype(scale_dtype) == np.uint8
            and _device_tbps() >= _MOE_LATENCY_KSPLIT_MIN_TBPS):
        return _MOE_LATENCY_KSPLIT
    return 1


# moe_linear takes the latency kernel up to this many CTAs (pairs x row tiles of
# an expert). H100, k=4 fp16, kernel-only (benchmarks/moe_latency_ab.py): 128
# experts of [1536, 2048] top-8 at T=1 (768 CTAs) 15.8 -> 13.7 us, T=2 (1536)
# 20.2 -> 21.8 us; of [2048, 768] at T=1 (1024) 10.2 -> 9.9 us, T=2 12.4 ->
# 13.8 us; 512 of [512, 2048] top-10 at T=1..3 (320..960) 12.2 -> 8.5,
# 15.2 -> 11.8, 17.6 -> 15.5 us.
_LATENCY_MOE_MAX_CTAS = 1024
# kbit_grouped_gemm takes it under the same bound (a CTA per row and row tile,
# each finding its row's expert in the offsets). H100, k=4 fp16, kernel-only
# (moe_vs_grouped_mm_h100_2917c19 before, _20b17fe after): T=1, 128 x
# [1536, 2048] top-8 14.6 -> 12.3 us, 512 x [512, 2048] top-10 11.4 -> 8.8 us,
# 128 x [2048, 768] 9.5 -> 9.5 us; T=2 on the last two 14.0 -> 13.6 and
# 11.8 -> 11.8 us. False: the grouped launch for every row count (tests).
_GROUPED_LATENCY = True
# On a GPU of _FAST_TBPS or more, experts of up to _LATENCY_MOE_FAST_MAX_WEIGHTS
# weights take it up to _LATENCY_MOE_MAX_CTAS_FAST CTAs. H200, k=4 fp16,
# kernel-only, in one process against 1024 (the same bound for both calls;
# results/moe_gap_probe_h200_latency_cap*_8436f3c.txt): 512 x [512, 2048]
# top-10 at T=4 (1280 CTAs) kbit_grouped_gemm 16.19 -> 15.28 us, moe_linear
# 17.97 -> 14.60; 128 x [1536, 2048] top-8 at T=2 (1536) 16.72 -> 16.86 and
# 18.08 -> 16.68; more CTAs lost: 128 x [2048, 768] at T=2 (2048) 10.27 ->
# 13.23 and 11.41 -> 12.05, all three at T=4 (512 experts T=5: 1600 CTAs, not
# asked) and T=8 (2560-8192) 3-74% slower. Larger experts keep 1024:
# Qwen3-235B's gate_up (128 x [3072, 4096], 1536 CTAs at T=1) at 1536 took
# 28.56 against 25.15 us (moe_linear 28.93 against 26.27;
# moe_gap_probe_h200_latency_cap_qwen_2fa07b3.txt); so does the H100 (1536
# CTAs 8% slower, above).
_LATENCY_MOE_MAX_CTAS_FAST = 1536
_LATENCY_MOE_FAST_MAX_WEIGHTS = 1 << 22


def _latency_moe_max_ctas(N: int, K_dim: int) -> int:
    """The most CTAs (rows x row tiles) the few-row launch takes for experts
    of [N, K_dim] on this GPU (_LATENCY_MOE_MAX_CTAS, or on a GPU of
    _FAST_TBPS or more for experts of up to _LATENCY_MOE_FAST_MAX_WEIGHTS
    weights _LATENCY_MOE_MAX_CTAS_FAST)."""
    if N * K_dim <= _LATENCY_MOE_FAST_MAX_WEIGHTS and _device_tbps() >= _FAST_TBPS:
        return _LATENCY_MOE_MAX_CTAS_FAST
    return _LATENCY_MOE_MAX_CTAS


def _grouped_wgmma(T: int, E: int) -> bool:
    """Whether the grouped launch of ``T`` rows over ``E`` experts runs on the
    Hopper path (sm_90 GPUs): where problems hold many rows (an even spread
    of more than _GROUPED_WG_MIN_ROWS rows per expert), whose multiplies
    wgmma runs faster than mma.sync. ``_GROUPED_WG`` overrides (A/B runs)."""
    if _GROUPED_WG is not None:
        return _GROUPED_WG and has_wgmma()
    return T / max(1, min(E, T)) > _GROUPED_WG_MIN_ROWS and has_wgmma()


_GROUPED_WIDE_WARPS = 8  # warps a CTA where _grouped_wide says (0: never, for A/B runs)


def _grouped_wide(experts: KbitExperts, wg: bool, m_tiles: int) -> bool:
    """Whether the grouped mma.sync launch runs 8 warps a CTA (gemm_mma.cu
    WARPS = 8: two CTAs per SM, the PRMT-addressed pair table, the scale
    after the multiply), as the dense launch does on large layers: k = 4 with
    E4M4 scales at one n8 tile (up to about 5 rows per expert) on sm_90.
    Kernel-only against 4 warps (results/moe_gap_probe_h{100,200}_grouped_wide_3ed1ab3.txt,
    T = 2..32 on 128 x [1536, 2048], 128 x [2048, 768] and 512 x [512, 2048]):
    H200 4-10% less time, H100 within 1.2% either way. Not measured without
    wgmma (sm_80): 4 warps there. (Where the 64 KB table does not fit the
    shared memory with the problem tables, the launch keeps 4 warps.)"""
    return bool(_GROUPED_WIDE_WARPS and not wg and m_tiles == 1 and experts.k == 4
                and experts.absmax.dtype == np.uint8 and has_wgmma())


_GROUPED_WG = None  # True / False: force the grouped launch's path (for A/B runs)
_GROUPED_WG_WARPGROUPS = None  # override of _jit.gemm_grouped_wg_warpgroups (for A/B runs)
# H100, k=4 (results/moe_mtiles_ab_h100_*): at 5 rows per expert the Hopper
# path's 16-row problems beat mma.sync by 3% (512 x [512, 2048]: 132.4 against
# 136.4 us), at 8 rows by -2..+3%; at 2.7 rows mma.sync wins by 9%.
_GROUPED_WG_MIN_ROWS = 4


def _grouped_launch(experts: KbitExperts, dtype, T: int, routed: bool, ids_per_row: int,
                    stream: int):
    """The grouped launch's Launch for ``T`` rows of C (pointers set per call)."""
    E, N, K_dim = experts.shape
    tiles, scales = experts.prepare()._tiles
    rt_n, kt_n = _tile_counts(N, K_dim)
    wg = _grouped_wgmma(T, E)
    choices = _jit.gemm_grouped_wg_m_tiles(experts.k)
    limit = int(_attributes()["MaxSharedMemoryPerBlockOptin"])
    while True:
        if wg:  # problems of 16 to 160 rows: wgmma's N
            m_tiles = grouped_wg_m_tiles(T, E, choices)
            wgs = _GROUPED_WG_WARPGROUPS or _jit.gemm_grouped_wg_warpgroups(m_tiles, experts.k)
        else:
            m_tiles, wgs = grouped_m_tiles(T, E), 0
        stage = m_tiles * 8 * K_PER_TILE * dtype.itemsize
        # the activation stages (wgmma: three, two past 16 n8 tiles, aligned at
        # run time to 1 KB), then the problem tables (and the routed ids and order)
        stages = _jit.gemm_wg_stages(m_tiles) * stage + 1024 if wg else 2 * stage
        shared = stages + 2 * (E + 1) * 4 + (2 * T * 4 if routed else 0)
        # (between the two: k = 4's PRMT-addressed pair table, where the kernel has it)
        wide = _grouped_wide(experts, wg, m_tiles)
        if wide:  # 8 warps where their table fits
            kern = _jit.get_kernel("gemm_mma", experts.k, dtype.name, experts.absmax.dtype.name,
                                   m_tiles, 1, wgs, True, _GROUPED_WIDE_WARPS)
            table = _jit.gemm_prmt_table_bytes(experts.k, m_tiles, wgs, True, _GROUPED_WIDE_WARPS)
            wide = kern.shared_size_bytes + shared + table <= limit
        if not wide:
            kern = _jit.get_kernel("gemm_mma", experts.k, dtype.name, experts.absmax.dtype.name,
                                   m_tiles, 1, wgs, True)
            table = _jit.gemm_prmt_table_bytes(experts.k, m_tiles, wgs, True, 4)
        shared += table
        fits = kern.shared_size_bytes + shared <= limit
        if routed and not fits:  # (the preferred size: the first pass)
            raise _RoutedTablesDoNotFit(
                f"{8 * m_tiles}-row problems with {2 * T * 4} bytes of routed ids and order")
        smaller = tuple(t for t in choices if t < m_tiles)
        if not wg or fits or not smaller:
            break
        choices = smaller  # 128-row stages with k=4's pair table and many experts: smaller problems
    warps = 4 * wgs if wg else _GROUPED_WIDE_WARPS if wide else _WARPS
    threads = 32 * warps
    rows_per_problem = 8 * m_tiles
    # gemm_mma.cu, "Grouped launch": the problem count is found on the device;
    # this bounds it (each expert with rows: one problem, plus one per full
    # rows_per_problem; offsets that fall could exceed it and are cut there by
    # the kernel) for the counters and the 32-bit unit index.
    max_problems = min(E, T) + T // rows_per_problem
    groups = math.ceil(rt_n / warps)
    # 32-bit unit, tile and counter indices; the kernel's saturating scan sums
    # up to one bound per thread
    if (max(groups * kt_n, rt_n) * max_problems >= 2**31 or E * rt_n * kt_n >= 2**31
            or max_problems * threads >= 2**31):
        raise ValueError(f"too much work for one grouped launch ({E} experts of [{N}, {K_dim}], "
                         f"{T} rows); split the rows into several calls")
    if kern.shared_size_bytes + shared > limit:
        raise ValueError(
            f"{E} experts need {kern.shared_size_bytes + shared} bytes of shared memory per CTA "
            f"in one grouped launch; this GPU allows {limit}. Split the experts into groups "
            "(separate KbitExperts) and launch each")
    # Every resident CTA: the kernel, knowing the unit count, uses all (stream-K) or
    # one per group (gemm_mma.cu, "Grouped launch").
    ctas = _sm_count() * launch_ctas_per_sm(kern, threads, shared)
    workspace = _workspace(2 * ctas * warps * m_tiles * 32 * 4, stream)
    counters = _counters(max_problems * rt_n, stream)
    return _launch.Launch(
        kern, (ctas, 1), (threads,), shared, _GEMM_ARG_TYPES,
        (tiles, scales, experts.codebook, 0, 0, T, N, K_dim, rt_n, kt_n, kt_n, _sm_count(),
         max_problems, workspace, counters, 0, E, 0, ids_per_row, 0, 0))


# --------------------------------------------------------------------------
# routing


@functools.cache
def _ids_kernel():
    import cupy as cp

    return cp.ElementwiseKernel("T x, int64 experts", "int32 y",
                                "y = (x < 0 || (long long)x >= experts) ? -1 : (int)x",
                                "kbit_ids_to_int32")


def _ids_int32(topk_ids, experts: int):
    """The flat ids as contiguous int32 for the kernels: int32 ids as they are,
    wider ones converted with those outside [0, experts) as -1 (they must not
    wrap into range), into a buffer kept per stream (one launch)."""
    import cupy as cp

    flat = topk_ids.reshape(-1)
    if flat.dtype == cp.int32:
        return cp.ascontiguousarray(flat)
    stream = _launch.current_stream_ptr()
    out = _launch.stream_buffer("moe_ids", 4 * flat.size, stream).view(cp.int32)[:flat.size]
    with _launch.relaxed():  # CuPy compiles the kernel on its first call
        return _ids_kernel()(flat, np.int64(experts), out)


def route_pairs(topk_ids, experts: int):
    """Group a router's choices by expert on the GPU, in one launch.

    topk_ids : CuPy integer array (any shape; flattened: pair i is token
        ``i // top_k``), ids outside ``[0, experts)`` get no row.
    Returns ``(offsets, order)``, CuPy int32: ``offsets`` ``[experts + 1]``
    (expert e owns sorted rows ``offsets[e] .. offsets[e+1] - 1``) and
    ``order`` ``[pairs]`` (sorted row -> pair; entries past
    ``offsets[experts]`` are unused). For ids all in range this is a stable
    sort (``numpy.argsort(ids, kind="stable")``); deterministic.
    """
    import cupy as cp

    if topk_ids.size >= 2**31:
        raise ValueError(f"routing on the GPU takes fewer than 2**31 choices, got {topk_ids.size}")
    route = _jit.get_kernel("moe_route", _jit.MOE_ROUTE_THREADS)
    warps, staged, shared = _route_geometry(route, int(experts), topk_ids.size)
    ids = _ids_int32(topk_ids, experts)
    # kept per stream, not freed after the call: a graph captured here writes them
    stream = _launch.current_stream_ptr()
    offsets = _launch.stream_buffer("moe_offsets", 4 * (int(experts) + 1), stream)
    offsets = offsets.view(cp.int32)[:int(experts) + 1]
    order = _launch.stream_buffer("moe_order", 4 * ids.size, stream).view(cp.int32)[:ids.size]
    route((1,), (_jit.MOE_ROUTE_THREADS,),
          (ids, np.int32(ids.size), np.int32(experts), np.int32(warps), offsets, order,
           np.int32(staged)),
          shared_mem=shared)
    return offsets, order


def _route_geometry(route, experts: int, pairs: int, staged: bool = True) -> tuple[int, bool, int]:
    """(warps, staged, dynamic shared bytes) of a moe_route.cu launch of
    ``route``: a warp per slice of the pairs while their (warp, expert) counts
    fit _ROUTE_SHARED_INTS; the ids and the order staged in shared memory
    where they fit too (opting in past 48 KB; ``staged=False``: never).
    ValueError past _ROUTE_SHARED_INTS experts."""
    warps = min(_jit.MOE_ROUTE_THREADS // 32, _ROUTE_SHARED_INTS // max(experts, 1))
    if warps < 1:
        raise ValueError(f"routing on the GPU takes at most {_ROUTE_SHARED_INTS} experts, got "
                         f"{experts}; group the rows yourself and call kbit_grouped_gemm")
    shared = 4 * warps * experts
    if staged:
        with _launch.setup_scope():  # (an attribute set and an occupancy query, once per size)
            staged = launch_ctas_per_sm(route, _jit.MOE_ROUTE_THREADS, shared + 8 * pairs) > 0
    return warps, staged, shared + (8 * pairs if staged else 0)


def moe_linear(x, topk_ids, experts: KbitExperts, out=None, validate: bool = True):
    """Each token through its router's top-k experts: ``[T, top_k, N]``.

    x : ``[T, K_dim]`` float16 or ``ml_dtypes.bfloat16`` token activations,
        NumPy or CuPy.
    topk_ids : ``[T, top_k]`` integer expert ids in ``[0, E)``, x's module.
    experts : a ``KbitExperts`` ``(E, N, K_dim)`` in x's place.
    out : optional C-contiguous ``[T, top_k, N]`` of x's dtype and module.
    validate : check the ids (on the GPU one small device-to-host copy, a
        synchronisation). Unchecked out-of-range ids leave their output rows
        unwritten; nothing outside the arrays is touched.

    Returns ``out[t, j] = x[t] @ dequant(W[topk_ids[t, j]]).T``. On the GPU
    with ``validate=False`` there is no host round trip: the fewest pairs
    (``T * top_k`` times the row tiles of an expert up to 1024) one launch
    of the latency kernel, one CTA per (pair, row tile), no grouping; up to
    4096 pairs one launch, in which every CTA of the ``kbit_grouped_gemm``
    kernel groups the pairs by expert itself (where their ids and order fit
    its shared memory); beyond that two launches, one
    grouping them (``kernels_src/moe_route.cu``, a stable counting sort) and
    the grouped one; ids wider than int32 add one conversion launch. Either
    way the rows of x and out are read and written in place through the
    sorted order; deterministic. Up to 11264
    experts for the routing; the grouped launch needs ``8 (E + 1)`` bytes of
    shared memory on top of its activation stages (a ValueError says when
    the GPU has too little).

    Raises TypeError (dtypes, places) and ValueError (shapes, ids out of
    range).
    """
    if not validate and _cupy_ndarray is not None and type(x) is _cupy_ndarray \
            and type(experts) is KbitExperts and type(topk_ids) is _cupy_ndarray \
            and topk_ids.ndim == 2 and topk_ids.shape[0] == x.shape[0] \
            and 0 < topk_ids.size <= _FUSED_ROUTE_MAX_PAIRS:
        T, top_k = topk_ids.shape
        C = _fast_launch(experts, x, T * top_k, True, top_k, out,
                         (T, top_k, experts.shape[1]), topk_ids)
        if C is not None:
            return C
    xp, x = as_module_array(x, "x")
    topk_ids = _integer_array(xp, topk_ids, "topk_ids", "x")
    if topk_ids.ndim != 2 or x.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, K_dim] and topk_ids [T, top_k] with the same T, got "
                         f"{x.shape} and {topk_ids.shape}")
    T, top_k = topk_ids.shape
    _, x = _check_inputs(x, experts)
    E, N, _ = experts.shape
    if validate and topk_ids.size:
        lo, hi = (int(v) for v in to_host(xp.stack([topk_ids.min(), topk_ids.max()])))
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids must be in [0, {E}) (E = {E} experts), got ids from "
                             f"{lo} to {hi}")
    C = _output(xp, out, (T, top_k, N), x.dtype)
    if C.size == 0:
        return C
    if xp is np:
        flat = topk_ids.reshape(-1).astype(np.int64)
        flat = np.where((flat < 0) | (flat >= E), E, flat)  # unchecked bad ids: no expert's rows
        order = np.argsort(flat, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E + 1)[:E])])
        rows = kbit_grouped_gemm(x[order // top_k], experts, offsets.astype(np.int32),
                                 validate=False)
        valid = order[: offsets[E]]
        C.reshape(T * top_k, N)[valid] = rows[: offsets[E]]
        return C
    # GPU: one launch groups the pairs (kernels_src/moe_route.cu), one multiplies
    # them, reading x's rows and writing C's through the sorted order.
    import cupy as cp

    x = cp.ascontiguousarray(x)
    if x.data.ptr % 16:
        x = x.copy()
    rows = C.reshape(T * top_k, N)
    # one launch, each CTA grouping the pairs itself, where they fit its shared memory
    # (the ids converted once: route_pairs takes the int32 ids as they are)
    in_launch = False
    if T * top_k <= _FUSED_ROUTE_MAX_PAIRS:
        topk_ids = _ids_int32(topk_ids, E)
        in_launch = _launch_grouped(x, experts, None, rows, None, top_k, route_ids=topk_ids)
    if not in_launch:
        with _launch.setup_scope():  # compiles the routing kernel once, outside a capture
            _jit.get_kernel("moe_route", _jit.MOE_ROUTE_THREADS)
        offsets, order = route_pairs(topk_ids, E)
        _launch_grouped(x, experts, offsets, rows, order, top_k)
    return C


__all__ = ["KbitExperts", "kbit_grouped_gemm", "moe_linear", "quantize_experts"]
