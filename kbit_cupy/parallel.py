"""Tensor parallelism: k-bit linear layers split over GPUs, combined with NCCL.

A ``[N, K_dim]`` weight is split one of two ways (``shard_weight``):

- ``axis="column"``: along N, in equal runs of whole rows. Shard ``r``
  computes columns ``r * N/n .. (r+1) * N/n`` of ``C = A @ W.T`` from the whole
  ``A``; an all-gather puts them side by side.
- ``axis="row"``: along K_dim, in equal runs of whole 32-column blocks (the
  FORMAT.md blocks, so every shard is a valid weight with the original's
  scales). Shard ``r`` multiplies its slice of ``A``'s columns; an all-reduce
  sums the ``n`` partial products.

Both are exact: a shard holds the original's bits (rows of ``packed`` and
``absmax`` for a column split, each row's run of blocks for a row split), and
``join_shards`` gives the original back bit for bit.

The MLP pattern (``TensorParallelMLP``): gate and up column-parallel with
their outputs kept local, SwiGLU on each GPU, down row-parallel: one
all-reduce per MLP and nothing else crosses GPUs.

Communication runs on ``cupy.cuda.nccl`` (one process per GPU: ``NcclGroup``;
or one process driving several GPUs: ``NcclGroup.create_all`` and
``parallel_forward``), on the caller's current CuPy stream, and can be
captured into a CUDA graph (NCCL 2.9.6 and later support capture).
``simulate_tensor_parallel`` runs the same per-shard products with the
collectives replaced by a local concatenation or sum, on NumPy or one GPU.

The row-parallel sum (FORMAT.md section 7): ``kbit_gemm`` returns its product
in the activation dtype, so each shard's partial product is already rounded
to fp16/bf16 before any communication; summing in float32 cannot undo that,
it only removes the ``n - 1`` roundings between shards. Measured on the NumPy
path (512 x 4096 weight, M = 16, relative Frobenius error against float64;
unsharded: fp16 2.1e-4, bf16 1.7e-3):

    shards   fp16 sum   fp32 sum (fp16)   bf16 sum   fp32 sum (bf16)
       2     3.0e-4     3.0e-4            2.5e-3     2.5e-3
       4     3.9e-4     3.0e-4            3.1e-3     2.4e-3
       8     5.1e-4     2.9e-4            4.0e-3     2.3e-3

The activation-dtype sum grows like sqrt(n) and stays 2.5x (bf16) to 4x
(fp16) inside the contract (1e-2, 2e-3) at 8 shards; it moves half the bytes
of a float32 sum and needs no conversion kernels, which matters at decode
sizes where the all-reduce is pure latency. ``reduce_dtype="auto"`` (the
default) therefore sums in the activation dtype up to
``AUTO_ACTIVATION_MAX_SHARDS`` shards and in float32 beyond;
``"activation"`` and ``"float32"`` force one.

Limit: because the partials are rounded before they are summed, an output
whose partials cancel carries their rounding error, not the result's. Over a
layer's output the Frobenius bound holds as measured above, but a tiny output
(a few elements) can pass it (one bf16 element of 4 shards: 1.4e-2), in
either reduce dtype. Float32 partials from ``kbit_gemm`` (an output dtype it
does not offer yet) would remove this.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ._arrays import (
    BFLOAT16,
    array_module,
    as_module_array,
    check_choice,
    check_mapping,
    check_path,
    is_device_array,
    to_host,
)
from .format import BLOCK
from .gemm import KbitWeight, check_activation_dtype, kbit_gemm
from .serialization import load_quantized, read_safetensors_metadata, save_quantized

AXES = ("column", "row")
REDUCE_DTYPES = ("auto", "activation", "float32")
# reduce_dtype="auto": the activation-dtype sum up to this many shards (see the
# module docstring's table), float32 beyond
AUTO_ACTIVATION_MAX_SHARDS = 8
# The user-metadata key of a shard file (save_shard); the rest of the file is
# an ordinary save_quantized file.
SHARD_METADATA_KEY = "kbit_cupy.tensor_parallel"
SHARD_FORMAT_VERSION = 1

# ncclDataType_t / ncclRedOp_t values (nccl.h); CuPy exposes most of them as
# nccl.NCCL_*, bfloat16 only where built against NCCL >= 2.10
_NCCL_TYPES = {"int64": 4, "float16": 6, "float32": 7, "bfloat16": 9}
_NCCL_SUM = 0


# --------------------------------------------------------------------------
# splitting and joining weights


def _check_count(n_shards) -> int:
    if isinstance(n_shards, (bool, np.bool_)) or not isinstance(n_shards, (int, np.integer)):
        raise TypeError(f"n_shards must be an integer >= 1, got {type(n_shards).__name__} "
                        f"{n_shards!r}")
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    return int(n_shards)


def _divisors(n: int, limit: int = 16) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _check_weight(w, name: str = "w") -> KbitWeight:
    if not isinstance(w, KbitWeight):
        raise TypeError(f"{name} must be a KbitWeight (from quantize_weight), got "
                        f"{type(w).__name__}")
    return w


def shard_weight(w: KbitWeight, n_shards: int, axis: str) -> list[KbitWeight]:
    """Split a ``[N, K_dim]`` weight into ``n_shards`` equal weights, exactly.

    axis : ``"column"`` (along N: shard ``r`` holds rows ``r * N/n ..``,
        shape ``[N/n, K_dim]``) or ``"row"`` (along K_dim in whole 32-column
        blocks: shard ``r`` holds columns ``r * K_dim/n ..`` of every row,
        shape ``[N, K_dim/n]``).

    Returns a list of ``KbitWeight`` in ``w``'s module (copies, independent of
    ``w``): their ``packed`` / ``absmax`` are the original's words and scales,
    their codebook the original's. ``join_shards(shards, axis)`` is ``w``
    again, bit for bit. Splits are equal so that every GPU does the same work
    and an all-gather can place the column shards; uneven splits are refused.

    Raises TypeError (``w`` not a KbitWeight, ``n_shards`` not an integer),
    ValueError (``n_shards < 1``; an axis other than the two; for "column",
    N not divisible by ``n_shards``; for "row", the ``K_dim / 32`` blocks
    not divisible by ``n_shards``; each message lists the counts that work).
    """
    w = _check_weight(w)
    n = _check_count(n_shards)
    check_choice(axis, "axis", AXES)
    xp = array_module(w.packed)
    N, K_dim = w.shape
    k, blocks = w.k, K_dim // BLOCK
    if axis == "column":
        if N % n:
            raise ValueError(f'axis="column" splits N={N} rows into {n} equal shards, but {N} '
                             f"is not a multiple of {n}; shard counts that divide N: "
                             f"{_divisors(N)}")
        rows = N // n
        words, scales = rows * blocks * k, rows * blocks
        return [KbitWeight(w.packed[r * words:(r + 1) * words].copy(),
                           w.absmax[r * scales:(r + 1) * scales].copy(),
                           w.codebook.copy(), k, (rows, K_dim)) for r in range(n)]
    if blocks % n:
        raise ValueError(f'axis="row" splits K_dim={K_dim} ({blocks} blocks of {BLOCK}) into {n} '
                         f"shards of whole blocks, but {blocks} is not a multiple of {n}; shard "
                         f"counts that divide the blocks: {_divisors(blocks)}")
    per = blocks // n
    packed = w.packed.reshape(N, blocks, k)
    absmax = w.absmax.reshape(N, blocks)
    return [KbitWeight(xp.ascontiguousarray(packed[:, r * per:(r + 1) * per]).reshape(-1),
                       xp.ascontiguousarray(absmax[:, r * per:(r + 1) * per]).reshape(-1),
                       w.codebook.copy(), k, (N, per * BLOCK)) for r in range(n)]


def _codebook_key(w: KbitWeight) -> int:
    return zlib.crc32(np.ascontiguousarray(to_host(w.codebook), dtype=np.float32).tobytes())


def join_shards(shards: Sequence[KbitWeight], axis: str) -> KbitWeight:
    """The weight whose ``shard_weight(.., axis)`` split gave ``shards``.

    ``"column"`` stacks the shards' rows (N adds up; K_dim must agree),
    ``"row"`` puts their blocks side by side in every row (K_dim adds up; N
    must agree). The shards may be of any sizes, so this also fuses
    weights, e.g. ``join_shards([gate, up], "column")`` is the gate_up
    weight. Exact: no value is requantized.

    Raises TypeError (not a sequence of KbitWeight; shards in different
    modules) and ValueError (no shards; an unknown axis; shards with
    different k, scale formats, codebooks, the wrong dimension disagreeing,
    or on different GPUs: move them to one place first).
    """
    check_choice(axis, "axis", AXES)
    if isinstance(shards, KbitWeight) or not isinstance(shards, Sequence):
        raise TypeError(f"shards must be a list of KbitWeight, got {type(shards).__name__}")
    if not shards:
        raise ValueError("shards is empty; give at least one KbitWeight")
    for i, s in enumerate(shards):
        _check_weight(s, f"shards[{i}]")
    first = shards[0]
    xp = array_module(first.packed)
    places = {(is_device_array(s.packed), s.packed.data.device_id if is_device_array(s.packed)
               else None) for s in shards}
    if len(places) > 1:
        kinds = {p[0] for p in places}
        if len(kinds) > 1:
            raise TypeError("shards mix NumPy and CuPy weights; move them to one place "
                            "(shard.to_device() or to the host) first")
        raise ValueError(f"shards live on different GPUs {sorted(p[1] for p in places)}; copy "
                         "them to one device (or the host) before joining")
    keep = 1 if axis == "column" else 0  # the dimension that must agree
    for i, s in enumerate(shards[1:], 1):
        if s.k != first.k or s.absmax.dtype != first.absmax.dtype:
            raise ValueError(f"shards[{i}] has k={s.k}, {s.absmax_format} scales but shards[0] "
                             f"k={first.k}, {first.absmax_format}; only shards of one format join")
        if s.shape[keep] != first.shape[keep]:
            dim = "K_dim" if keep else "N"
            raise ValueError(f'axis="{axis}" joins shards of equal {dim}, but shards[{i}] has '
                             f"shape {s.shape} and shards[0] {first.shape}")
        if _codebook_key(s) != _codebook_key(first):
            raise ValueError(f"shards[{i}]'s codebook differs from shards[0]'s; a joined weight "
                             "has one codebook (quantize both parts with the same codebook=)")
    k = first.k
    if axis == "column":
        packed = xp.concatenate([s.packed for s in shards])
        absmax = xp.concatenate([s.absmax for s in shards])
        shape = (sum(s.shape[0] for s in shards), first.shape[1])
    else:
        N = first.shape[0]
        packed = xp.concatenate([s.packed.reshape(N, -1, k) for s in shards], axis=1).reshape(-1)
        absmax = xp.concatenate([s.absmax.reshape(N, -1) for s in shards], axis=1).reshape(-1)
        shape = (N, sum(s.shape[1] for s in shards))
    return KbitWeight(packed, absmax, first.codebook.copy(), k, shape)


# --------------------------------------------------------------------------
# whole models: split, join, one safetensors file per shard


def _check_plan(model: Mapping, plan) -> dict[str, str]:
    check_mapping(plan, "plan", '{name: "column" | "row"}')
    for name, axis in plan.items():
        if name not in model:
            raise ValueError(f"plan names {name!r}, which the model does not have; its entries: "
                             f"{sorted(model)[:8]}")
        check_choice(axis, f"plan[{name!r}]", AXES)
    return dict(plan)


def _split_array(name: str, value, n: int, axis: str) -> list:
    xp, value = as_module_array(value, name)
    dim = 0 if axis == "column" else value.ndim - 1
    if value.ndim == 0 or value.shape[dim] % n:
        raise ValueError(f"{name!r} of shape {value.shape} cannot be split into {n} equal parts "
                         f'along its {"first" if dim == 0 else "last"} axis ({axis!r})')
    return [xp.ascontiguousarray(part) for part in xp.split(value, n, axis=dim)]


def shard_model(model: Mapping, n_shards: int, plan: Mapping[str, str]) -> list[dict]:
    """Split a model ``{name: KbitWeight | array}`` for ``n_shards`` GPUs.

    plan : ``{name: "column" | "row"}``. Weights named there go through
        ``shard_weight``; arrays named there are split in equal parts along
        their first axis ("column": e.g. a column-parallel layer's bias) or
        last axis ("row"). Everything not named is copied to every shard
        (norms, embeddings, a row-parallel layer's bias, which is added once
        after the all-reduce).

    Returns ``n_shards`` dicts with the model's names. Raises ValueError for
    plan names the model lacks, unknown axes and sizes that do not split.
    """
    check_mapping(model, "model", "{name: KbitWeight | array}")
    n = _check_count(n_shards)
    plan = _check_plan(model, plan)
    out: list[dict] = [{} for _ in range(n)]
    for name, value in model.items():
        axis = plan.get(name)
        if axis is None:
            parts = [value] * n
        elif isinstance(value, KbitWeight):
            parts = shard_weight(value, n, axis)
        else:
            parts = _split_array(name, value, n, axis)
        for r in range(n):
            out[r][name] = parts[r]
    return out


def join_model(shard_models: Sequence[Mapping], plan: Mapping[str, str]) -> dict:
    """Inverse of ``shard_model``: the whole model from its shards (in rank order)."""
    if not shard_models:
        raise ValueError("shard_models is empty")
    first = shard_models[0]
    plan = _check_plan(first, plan)
    for r, m in enumerate(shard_models):
        if set(m) != set(first):
            raise ValueError(f"shard {r} has entries {sorted(set(m) ^ set(first))} that shard 0 "
                             "does not (or the other way round); they are not one model's shards")
    model = {}
    for name, value in first.items():
        axis = plan.get(name)
        parts = [m[name] for m in shard_models]
        if axis is None:
            model[name] = value
        elif isinstance(value, KbitWeight):
            model[name] = join_shards(parts, axis)
        else:
            xp = array_module(value)
            model[name] = xp.concatenate(parts, axis=0 if axis == "column" else value.ndim - 1)
    return model


@dataclass(frozen=True)
class ShardPlace:
    """Where a shard file belongs: shard ``rank`` of ``n_shards``, split by ``plan``."""

    rank: int
    n_shards: int
    plan: dict

    def __post_init__(self):
        n = _check_count(self.n_shards)
        if (isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer))
                or not 0 <= self.rank < n):
            raise ValueError(f"rank must be an integer in 0..{n - 1}, got {self.rank!r}")


def shard_path(prefix: str | os.PathLike, rank: int, n_shards: int) -> str:
    """``PREFIX-00001-of-00004.safetensors`` for rank 0 of 4 (Hugging Face's numbering)."""
    return f"{os.fspath(prefix)}-{rank + 1:05d}-of-{n_shards:05d}.safetensors"


def save_shard(path: str | os.PathLike, shard: Mapping, place: ShardPlace,
               metadata: Mapping[str, str] | None = None) -> None:
    """Write one shard of a model (``shard_model``'s ``r``-th dict) to its own file.

    An ordinary ``save_quantized`` file (checksums, atomic write); the user
    metadata key ``"kbit_cupy.tensor_parallel"`` records ``place`` (rank,
    shard count, plan) as JSON. ``metadata``: your own ``{str: str}``, next
    to it. Raises ValueError if ``metadata`` uses that key or the plan names
    entries ``shard`` lacks, plus what ``save_quantized`` raises.
    """
    if not isinstance(place, ShardPlace):
        raise TypeError(f"place must be a ShardPlace(rank, n_shards, plan), got "
                        f"{type(place).__name__}")
    check_mapping(shard, "shard", "{name: KbitWeight | array}")
    plan = _check_plan(shard, place.plan)
    metadata = dict(metadata or {})
    if SHARD_METADATA_KEY in metadata:
        raise ValueError(f"the metadata key {SHARD_METADATA_KEY!r} is reserved for the shard's "
                         "place; use another key")
    metadata[SHARD_METADATA_KEY] = json.dumps({
        "version": SHARD_FORMAT_VERSION, "rank": int(place.rank),
        "n_shards": int(place.n_shards), "plan": plan})
    save_quantized(path, shard, metadata)


def save_sharded(prefix: str | os.PathLike, shard_models: Sequence[Mapping],
                 plan: Mapping[str, str], metadata: Mapping[str, str] | None = None) -> list[str]:
    """All shards from one process: ``save_shard`` to ``shard_path(prefix, r, n)``; returns the paths."""
    n = len(shard_models)
    paths = [shard_path(prefix, r, n) for r in range(n)]
    for r, (path, shard) in enumerate(zip(paths, shard_models)):
        save_shard(path, shard, ShardPlace(r, n, dict(plan)), metadata)
    return paths


def read_shard_place(path: str | os.PathLike) -> ShardPlace:
    """The ``ShardPlace`` a shard file records (only the header is read).

    Raises ValueError (naming the file) for a file without one (not written
    by ``save_shard``) or with a damaged one, plus what
    ``read_safetensors_metadata`` raises.
    """
    check_path(path)
    raw = read_safetensors_metadata(path).get(SHARD_METADATA_KEY)
    where = os.fspath(path)
    if raw is None:
        raise ValueError(f"{where}: not a shard file (no {SHARD_METADATA_KEY!r} metadata); load "
                         "it with load_quantized, or write shards with save_shard")
    try:
        doc = json.loads(raw)
        if doc.get("version") != SHARD_FORMAT_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, this kbit_cupy reads "
                             f"{SHARD_FORMAT_VERSION}")
        plan = doc["plan"]
        if not isinstance(plan, dict) or not all(v in AXES for v in plan.values()):
            raise ValueError(f"plan {plan!r}")
        return ShardPlace(doc["rank"], doc["n_shards"], plan)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{where}: the {SHARD_METADATA_KEY!r} metadata is damaged ({exc}); write "
                         "the shard again with save_shard") from exc


def load_shard(path: str | os.PathLike, *, rank: int, n_shards: int, device: str = "cpu",
               verify: bool = True) -> dict:
    """Read shard ``rank`` of ``n_shards`` written by ``save_shard``.

    The recorded place is checked before any tensor is read: a file saved
    for another shard count or rank is refused with ValueError saying what
    it holds and how to reshard (``load_sharded`` joins all the files,
    ``shard_model`` splits again). Then ``load_quantized(path, device=,
    verify=)``; its errors pass through. Returns ``{name: KbitWeight | array}``.
    """
    place = read_shard_place(path)
    where = os.fspath(path)
    if place.n_shards != n_shards:
        raise ValueError(
            f"{where} is shard {place.rank + 1} of {place.n_shards}, but this run uses "
            f"{n_shards} shards; shards do not fit another shard count. Reshard: "
            f"model, plan = load_sharded(the {place.n_shards} files); "
            f"shard_model(model, {n_shards}, plan); save_sharded(...)")
    if place.rank != rank:
        raise ValueError(f"{where} is shard {place.rank + 1} of {place.n_shards} (rank "
                         f"{place.rank}), but rank {rank} asked for it; load "
                         f"shard_path(prefix, {rank}, {n_shards}) instead")
    return load_quantized(path, device=device, verify=verify)


def load_sharded(paths: Sequence[str | os.PathLike], *, device: str = "cpu",
                 verify: bool = True) -> tuple[dict, dict]:
    """Join the files of one sharded model: ``(whole model, plan)``.

    ``paths`` in any order; together they must be ranks 0..n-1 of one
    ``n``, each once, with one plan (ValueError naming the file otherwise).
    The result can be split for another GPU count with ``shard_model``.
    """
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise TypeError("paths must be a non-empty list of shard files")
    places = [read_shard_place(p) for p in paths]
    n = places[0].n_shards
    by_rank: dict[int, str] = {}
    for p, place in zip(paths, places):
        if place.n_shards != n or place.plan != places[0].plan:
            raise ValueError(f"{os.fspath(p)} belongs to a {place.n_shards}-shard model with plan "
                             f"{place.plan}, {os.fspath(paths[0])} to a {n}-shard one with plan "
                             f"{places[0].plan}; they are not one model's shards")
        if place.rank in by_rank:
            raise ValueError(f"{os.fspath(p)} and {os.fspath(by_rank[place.rank])} are both shard "
                             f"{place.rank + 1} of {n}")
        by_rank[place.rank] = p
    missing = sorted(set(range(n)) - by_rank.keys())
    if missing:
        raise ValueError(f"shards {[r + 1 for r in missing]} of {n} are missing from paths")
    shards = [load_quantized(by_rank[r], device=device, verify=verify) for r in range(n)]
    return join_model(shards, places[0].plan), dict(places[0].plan)


# --------------------------------------------------------------------------
# the per-shard products and their combination


def _resolve_reduce(reduce_dtype: str, n_shards: int) -> str:
    check_choice(reduce_dtype, "reduce_dtype", REDUCE_DTYPES)
    if reduce_dtype == "auto":
        return "activation" if n_shards <= AUTO_ACTIVATION_MAX_SHARDS else "float32"
    return reduce_dtype


def _input_slice(A, rank: int, n_shards: int, k_shard: int):
    """Shard ``rank``'s columns of a row-parallel input: ``A`` itself if it has
    ``k_shard`` columns (already split), its slice if it has ``n * k_shard``."""
    if A.shape[-1] == k_shard:
        return A
    if A.shape[-1] == n_shards * k_shard:
        return A[..., rank * k_shard:(rank + 1) * k_shard]
    raise ValueError(f"A's last dimension must be the shard's K_dim={k_shard} (already split) "
                     f"or the whole K_dim={n_shards * k_shard}, got shape {A.shape}")


def _sum_partials(xp, partials: list, mode: str):
    """The rank-order sum of equal-shape partial products (the all-reduce's
    local stand-in): in the activation dtype, rounding after every addition
    like an activation-dtype all-reduce, or in float32 rounded once."""
    dtype = partials[0].dtype
    if mode == "float32":
        total = partials[0].astype(np.float32)
        for p in partials[1:]:
            total += p.astype(np.float32)
        return total.astype(dtype)
    total = partials[0]
    for p in partials[1:]:
        total = (total.astype(np.float32) + p.astype(np.float32)).astype(dtype)
    return total


def simulate_tensor_parallel(A, shards: Sequence[KbitWeight], axis: str, *,
                             gather_output: bool = True, reduce_dtype: str = "auto",
                             kernel: str = "auto"):
    """The tensor-parallel product on one device, collectives done locally.

    A : ``[..., K_dim]`` fp16/bf16 (NumPy or CuPy, where the shards are);
        for ``axis="row"`` the whole input (each shard takes its columns).
    shards : ``shard_weight(w, n, axis)``, in rank order.

    Each shard's product is the ``kbit_gemm`` call a ``TensorParallelLinear``
    on that rank makes (same kernel choice, same bits). "column" then puts
    the ``n`` outputs side by side (exactly what the all-gather does), or
    with ``gather_output=False`` returns the list of local outputs; "row"
    sums the partial products in rank order in the dtype ``reduce_dtype``
    picks (an all-reduce's order is NCCL's, so its bits may differ by that
    order; the error bound is the same). Returns ``[..., N]`` in A's dtype.
    """
    check_choice(axis, "axis", AXES)
    if not shards:
        raise ValueError("shards is empty")
    n = len(shards)
    xp, A = as_module_array(A, "A")
    check_activation_dtype(A)
    if axis == "column":
        outs = [kbit_gemm(A, s, kernel=kernel) for s in shards]
        return xp.concatenate(outs, axis=-1) if gather_output else outs
    mode = _resolve_reduce(reduce_dtype, n)
    partials = [kbit_gemm(_input_slice(A, r, n, s.shape[1]), s, kernel=kernel)
                for r, s in enumerate(shards)]
    return _sum_partials(xp, partials, mode)


# --------------------------------------------------------------------------
# NCCL


def _nccl():
    from cupy.cuda import nccl

    if not nccl.available:
        raise RuntimeError("NCCL is not available to CuPy (libnccl.so.2 did not load); install "
                           'it with pip install "nvidia-nccl-cu12>=2.18.1,<3" (CUDA 12)')
    return nccl


def new_unique_id() -> bytes | tuple:
    """An NCCL unique id (bytes in CuPy 14, a tuple of ints before; picklable
    either way): make it in one process and give it to every rank's
    ``NcclGroup.create``."""
    return _nccl().get_unique_id()


class NcclGroup:
    """One rank's NCCL communicator, with its rank, size and GPU read once.

    ``NcclGroup(comm)`` wraps a ``cupy.cuda.nccl.NcclCommunicator``;
    ``NcclGroup.create(unique_id, size, rank, device)`` makes one (every
    rank must call it: it waits for all); ``NcclGroup.create_all(devices)``
    makes one per device for a single process.
    """

    def __init__(self, comm):
        self.comm = comm
        self.rank = int(comm.rank_id())
        self.size = int(comm.size())
        self.device = int(comm.device_id())

    @classmethod
    def create(cls, unique_id: bytes | tuple, size: int, rank: int, device: int) -> NcclGroup:
        import cupy as cp

        nccl = _nccl()
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in 0..{size - 1}, got {rank}")
        with cp.cuda.Device(device):
            # CuPy 14 takes the id as bytes (get_unique_id's own type); older
            # releases gave and took a tuple of ints
            uid = unique_id if isinstance(unique_id, (bytes, tuple)) else tuple(unique_id)
            return cls(nccl.NcclCommunicator(size, uid, rank))

    @classmethod
    def create_all(cls, devices: Sequence[int]) -> list[NcclGroup]:
        """One communicator per device, all in this process (``ncclCommInitAll``)."""
        return [cls(c) for c in _nccl().NcclCommunicator.initAll(list(devices))]

    @staticmethod
    def group_start() -> None:
        """ncclGroupStart: the calls up to ``group_end`` are issued together."""
        _nccl().groupStart()

    @staticmethod
    def group_end() -> None:
        _nccl().groupEnd()

    def all_gather(self, buffer, count: int, stream_ptr: int) -> None:
        """In place: rank r's ``count`` elements sit at ``buffer[r * count:]``."""
        send = buffer.data.ptr + self.rank * count * buffer.dtype.itemsize
        self.comm.allGather(send, buffer.data.ptr, count, _nccl_type(buffer.dtype), stream_ptr)

    def all_reduce(self, buffer, stream_ptr: int) -> None:
        """In place: the sum over ranks."""
        self.comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                            _nccl_type(buffer.dtype), _NCCL_SUM, stream_ptr)


def _nccl_type(dtype) -> int:
    name = "bfloat16" if np.dtype(dtype) == BFLOAT16 else np.dtype(dtype).name
    return _NCCL_TYPES[name]


def _group_calls(groups_and_calls) -> None:
    """Run ``(group, call)`` pairs, each under its group's device; several at
    once (one process driving several GPUs) inside ncclGroupStart/End so
    that no call waits for a peer this thread has not reached yet."""
    import cupy as cp

    if len(groups_and_calls) == 1:
        group, call = groups_and_calls[0]
        with cp.cuda.Device(group.device):
            call()
        return
    first = groups_and_calls[0][0]
    first.group_start()
    try:
        for group, call in groups_and_calls:
            with cp.cuda.Device(group.device):
                call()
    finally:
        first.group_end()


# A rank's description of the shard it holds, exchanged once when layers are
# built so that every rank sees a mismatch and raises together, not hangs:
# (problem flag, n_shards, rank, axis, N, K_dim of the whole weight, k, scale
# format, codebook CRC-32)
_DESCRIPTION = ("problem", "n_shards", "rank", "axis", "N", "K_dim", "k", "scales", "codebook")


class TensorParallelLinear:
    """One rank's part of a k-bit linear layer split over GPUs.

    shard : this rank's ``shard_weight(w, n, axis)[rank]``, on this rank's GPU.
    axis : ``"column"`` or ``"row"`` (how ``shard`` was split).
    group : this rank's ``NcclGroup`` (or an object with its ``rank``,
        ``size``, ``device``, ``all_gather``, ``all_reduce``, ``group_start``
        and ``group_end``); its size must be ``n``, its rank the shard's, its
        GPU the one ``shard`` lives on.
    n_shards, rank : the split the shard comes from (default: the group's);
        given explicitly they are checked against the group.
    gather_output : column-parallel only: all-gather the ``[..., N]`` output
        (default), or return this rank's ``[..., N/n]`` (for a row-parallel
        layer next, as in the MLP).
    reduce_dtype : row-parallel only: ``"auto"``, ``"activation"`` or
        ``"float32"`` (module docstring).
    check_peers : exchange a small description of every rank's shard when
        the layer is built (one NCCL all-gather of 9 integers, then a host
        sync) and raise on every rank if they disagree (default). Build
        layers in the same order on every rank.

    ``layer(A)``: ``kbit_gemm`` on the current CuPy stream, then the
    collective on the same stream; nothing waits on the host, and the call
    can be captured into a CUDA graph (after one eager call has built the
    kernels' plans, as for ``kbit_gemm``). Row-parallel ``A`` is this rank's
    ``[..., K_dim/n]`` slice, or the whole ``[..., K_dim]`` input.

    Errors found when the layer is built (a group of the wrong size, a
    shard from another split, on another GPU, or different from the peers'
    shards) raise ValueError on every rank before any collective on the
    data; with ``check_peers=False`` only on the rank that sees them (the
    others then wait in their next collective). Per-call errors (A's shape,
    dtype or GPU) are local: every rank given the same shapes raises alike.
    """

    def __init__(self, shard: KbitWeight, axis: str, group, *, n_shards: int | None = None,
                 rank: int | None = None, gather_output: bool = True,
                 reduce_dtype: str = "auto", check_peers: bool = True):
        self._init_local(shard, axis, group, n_shards, rank, gather_output, reduce_dtype)
        if check_peers:
            _check_peers([self])
        elif self._problem:
            raise ValueError(self._problem)

    @classmethod
    def build_all(cls, shards: Sequence[KbitWeight], axis: str, groups: Sequence[NcclGroup],
                  **options) -> list[TensorParallelLinear]:
        """One process driving every GPU: the layer of each (shard, group), checked together."""
        if len(shards) != len(groups):
            raise ValueError(f"{len(shards)} shards for {len(groups)} groups; give one shard per "
                             "GPU")
        check_peers = options.pop("check_peers", True)
        layers = []
        for r, (shard, group) in enumerate(zip(shards, groups)):
            layer = cls.__new__(cls)
            layer._init_local(shard, axis, group, options.get("n_shards"), r,
                              options.get("gather_output", True),
                              options.get("reduce_dtype", "auto"))
            layers.append(layer)
        if check_peers:
            _check_peers(layers)
        else:
            for layer in layers:
                if layer._problem:
                    raise ValueError(layer._problem)
        return layers

    def _init_local(self, shard, axis, group, n_shards, rank, gather_output, reduce_dtype):
        _check_weight(shard, "shard")
        self.axis = check_choice(axis, "axis", AXES)
        self.shard, self.group = shard, group
        self.n_shards = group.size if n_shards is None else _check_count(n_shards)
        self.rank = group.rank if rank is None else int(rank)
        self.gather_output = bool(gather_output)
        self.reduce = _resolve_reduce(reduce_dtype, self.n_shards)
        N, K_dim = shard.shape
        self.full_shape = (N * self.n_shards, K_dim) if axis == "column" else (
            N, K_dim * self.n_shards)
        self.device = group.device
        self._problem = self._local_problem()

    def _local_problem(self) -> str | None:
        """What is wrong on this rank, found without talking to the others."""
        g = self.group
        if g.size != self.n_shards:
            return (f"the communicator has {g.size} ranks but the shard is 1 of "
                    f"{self.n_shards}; split the weight with shard_weight(w, {g.size}, "
                    f"{self.axis!r}) or make a communicator of {self.n_shards} ranks")
        if g.rank != self.rank:
            return (f"rank {g.rank} of the communicator holds shard {self.rank}; give rank r "
                    "shard r (shard_weight(...)[group.rank])")
        if not is_device_array(self.shard.packed):
            return (f"rank {g.rank}'s shard is a NumPy weight; move it to GPU {g.device} "
                    "(under cupy.cuda.Device(group.device): shard.to_device())")
        dev = self.shard.packed.data.device_id
        if dev != g.device:
            return (f"rank {g.rank}'s shard is on GPU {dev} but its communicator on GPU "
                    f"{g.device}; copy it with shard.to_device() under "
                    f"cupy.cuda.Device({g.device})")
        return None

    def _description(self) -> np.ndarray:
        return np.array([int(self._problem is not None), self.n_shards, self.rank,
                         AXES.index(self.axis), *self.full_shape, self.shard.k,
                         int(self.shard.absmax.dtype == np.uint8), _codebook_key(self.shard)],
                        dtype=np.int64)

    # -- the call ---------------------------------------------------------

    def _local(self, A, stream):
        """This rank's product, in the buffer the collective works on; returns
        (buffer, output shape or None, collective or None, activation-dtype
        output of a float32 sum or None)."""
        xp = _cupy_module()
        if not isinstance(A, xp.ndarray):
            raise TypeError(f"A must be a CuPy array on GPU {self.device}, got "
                            f"{type(A).__name__}")
        if A.data.device_id != self.device:
            raise ValueError(f"A is on GPU {A.data.device_id} but this rank's shard on GPU "
                             f"{self.device}; copy A there first")
        check_activation_dtype(A)
        from . import _launch

        N_local, K_local = self.shard.shape
        if self.axis == "row":
            A = _input_slice(A, self.rank, self.n_shards, K_local)
            C = kbit_gemm(A, self.shard)
            if self.reduce == "activation":
                return C, C.shape, (lambda: self.group.all_reduce(C, stream.ptr)), None
            wide = _launch.empty(C.shape, np.float32, C.size * 4, stream)
            with _launch.relaxed():
                xp.copyto(wide, C)
            return wide, C.shape, (lambda: self.group.all_reduce(wide, stream.ptr)), C
        if A.shape[-1] != K_local:
            raise ValueError(f"A's last dimension must be K_dim={K_local}, got shape {A.shape}")
        lead = A.shape[:-1]
        if not self.gather_output:
            return kbit_gemm(A, self.shard), None, None, None
        M = math.prod(lead)
        n = self.n_shards
        gathered = _launch.empty((n, M, N_local), A.dtype, n * M * N_local * A.dtype.itemsize,
                                 stream)
        kbit_gemm(A.reshape(M, K_local), self.shard, out=gathered[self.rank])
        return gathered, lead, (lambda: self.group.all_gather(gathered, M * N_local,
                                                              stream.ptr)), None

    def _finish(self, buffer, shape, narrow):
        """The output from the buffer after the collective."""
        if shape is None:  # column-parallel without a gather: the local output
            return buffer
        if self.axis == "row":
            if narrow is None:
                return buffer
            from . import _launch

            with _launch.relaxed():
                _cupy_module().copyto(narrow, buffer)
            return narrow
        n, M, N_local = buffer.shape
        if M == 1:  # [n, 1, N/n] is [1, N] already
            return buffer.reshape(shape + (n * N_local,))
        from . import _launch

        out = _launch.empty((M, n, N_local), buffer.dtype, buffer.nbytes)
        with _launch.relaxed():
            _cupy_module().copyto(out, buffer.transpose(1, 0, 2))
        return out.reshape(shape + (n * N_local,))

    def __call__(self, A):
        """``A @ W.T`` for the whole weight W (column-parallel with gather,
        row-parallel), or this rank's columns of it (column, no gather)."""
        import cupy as cp

        stream = cp.cuda.get_current_stream()
        buffer, shape, collective, narrow = self._local(A, stream)
        if collective is not None:
            collective()
        out = self._finish(buffer, shape, narrow)
        # what the call's kernels and collective wrote: keep it as long as a
        # CUDA graph captured from this call lives (CuPy's pool would reuse it)
        self.buffers = (buffer, narrow, out)
        return out


def _cupy_module():
    import cupy

    return cupy


def _check_peers(layers: Sequence[TensorParallelLinear]) -> None:
    """All-gather every rank's shard description (the layers of this process,
    one per GPU it drives) and raise on every rank if any rank found a
    problem or the shards are not one split of one weight."""
    import cupy as cp

    exchanges = []
    for layer in layers:
        g = layer.group
        with cp.cuda.Device(g.device):
            desc = layer._description()
            buf = cp.zeros((g.size, desc.size), dtype=np.int64)
            buf[g.rank] = cp.asarray(desc)
            exchanges.append((layer, buf))
    _group_calls([(layer.group, lambda layer=layer, buf=buf: layer.group.all_gather(
        buf, buf.shape[1], cp.cuda.get_current_stream().ptr)) for layer, buf in exchanges])
    for layer, buf in exchanges:
        with cp.cuda.Device(layer.group.device):
            table = cp.asnumpy(buf)  # waits for the exchange
        problem = layer._problem or _disagreement(table)
        if problem:
            raise ValueError(f"tensor-parallel layer (rank {layer.group.rank}): {problem}")


def _disagreement(table: np.ndarray) -> str | None:
    """What the ranks' descriptions (rows of ``table``) say is wrong, or None."""
    col = {name: table[:, i] for i, name in enumerate(_DESCRIPTION)}
    flagged = np.flatnonzero(col["problem"])
    if flagged.size:
        return (f"ranks {flagged.tolist()} found a problem with their shard (their own error "
                "says which); no rank ran the layer")
    for r in range(table.shape[0]):
        if col["rank"][r] != r:
            return f"communicator rank {r} holds shard {col['rank'][r]}; rank r needs shard r"
    for name in ("n_shards", "axis", "N", "K_dim", "k", "scales", "codebook"):
        values = col[name]
        if (values != values[0]).any():
            shown = [AXES[v] for v in values] if name == "axis" else values.tolist()
            return (f"the ranks' shards disagree on {name}: {shown} by rank; they are not one "
                    "shard_weight split of one weight")
    return None


def parallel_forward(layers: Sequence[TensorParallelLinear], inputs: Sequence) -> list:
    """One process driving several GPUs: ``layers[r](inputs[r])`` for every
    rank, the collectives grouped (ncclGroupStart/End) so that one thread
    can issue them all. Each rank's work runs on its device's current stream."""
    import cupy as cp

    if len(layers) != len(inputs):
        raise ValueError(f"{len(layers)} layers for {len(inputs)} inputs; give one input per GPU")
    pending = []
    for layer, A in zip(layers, inputs):
        with cp.cuda.Device(layer.device):
            stream = cp.cuda.get_current_stream()
            pending.append((layer, *layer._local(A, stream)))
    calls = [(layer.group, collective) for layer, _, _, collective, _ in pending
             if collective is not None]
    if calls:
        _group_calls(calls)
    outs = []
    for layer, buffer, shape, _, narrow in pending:
        with cp.cuda.Device(layer.device):
            outs.append(layer._finish(buffer, shape, narrow))
            layer.buffers = (buffer, narrow, outs[-1])
    return outs


# --------------------------------------------------------------------------
# the MLP: gate and up column-parallel, down row-parallel, one all-reduce


def shard_mlp(gate: KbitWeight, up: KbitWeight, down: KbitWeight,
              n_shards: int) -> list[tuple[KbitWeight, KbitWeight]]:
    """Split a gated MLP ``down(silu(gate(x)) * up(x))`` for ``n_shards`` GPUs.

    gate, up : ``[I, H]``; down : ``[H, I]`` (one codebook for gate and up).
    Returns per rank ``(gate_up, down)``: ``gate_up`` is rank r's gate rows
    followed by its up rows (``[2 I/n, H]``, column-parallel, output kept
    local), ``down`` its ``[H, I/n]`` row-parallel shard, whose columns are
    exactly the intermediate features rank r computes. Raises ValueError for
    mismatched shapes or an ``n_shards`` that does not divide I into whole
    32-column blocks.
    """
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        _check_weight(w, name)
    if gate.shape != up.shape or down.shape != gate.shape[::-1]:
        raise ValueError(f"gate and up must be [I, H] and down [H, I], got gate {gate.shape}, "
                         f"up {up.shape}, down {down.shape}")
    gates = shard_weight(gate, n_shards, "column")
    ups = shard_weight(up, n_shards, "column")
    downs = shard_weight(down, n_shards, "row")
    return [(join_shards([g, u], "column"), d) for g, u, d in zip(gates, ups, downs)]


_swiglu_kernels: dict = {}


def swiglu(h, out=None):
    """``silu(h[..., :I]) * h[..., I:]`` for ``h`` of shape ``[..., 2 I]``
    (fp16 / bf16, NumPy or CuPy), computed in float32 and rounded once to h's
    dtype; ``[..., I]``. On the GPU one elementwise kernel, into ``out`` if
    given (else a new array)."""
    xp, h = as_module_array(h, "h")
    half = h.shape[-1] // 2
    if h.shape[-1] % 2:
        raise ValueError(f"h's last dimension must be even (gate and up halves), got {h.shape}")
    gate, up = h[..., :half], h[..., half:]
    if xp is np:
        g = gate.astype(np.float32)
        y = (g / (np.float32(1) + np.exp(-g)) * up.astype(np.float32)).astype(h.dtype)
        if out is None:
            return y
        out[...] = y
        return out
    from . import _launch

    kern = _swiglu_kernels.get("swiglu")
    if kern is None:
        kern = _swiglu_kernels["swiglu"] = xp.ElementwiseKernel(
            "T g, T u", "T y",
            "const float x = (float)g; y = (T)(x / (1.0f + expf(-x)) * (float)u);",
            "kbit_parallel_swiglu")
    if out is None:
        out = _launch.empty(h.shape[:-1] + (half,), h.dtype)
    with _launch.relaxed():  # a first call compiles and loads the kernel
        kern(gate, up, out)
    return out


def mlp_reference(x, gate_up: KbitWeight, down: KbitWeight):
    """The unsharded MLP ``down(swiglu(gate_up(x)))`` (one device)."""
    return kbit_gemm(swiglu(kbit_gemm(x, gate_up)), down)


def simulate_mlp(x, shards: Sequence[tuple[KbitWeight, KbitWeight]], *,
                 reduce_dtype: str = "auto"):
    """``TensorParallelMLP`` on one device: every rank's products (the same
    calls, the same bits), the all-reduce replaced by a rank-order sum."""
    xp, x = as_module_array(x, "x")
    mode = _resolve_reduce(reduce_dtype, len(shards))
    partials = [kbit_gemm(swiglu(kbit_gemm(x, gate_up)), down) for gate_up, down in shards]
    return _sum_partials(xp, partials, mode)


class TensorParallelMLP:
    """One rank's gated MLP: gate_up column-parallel (output kept on the
    rank), SwiGLU, down row-parallel; one all-reduce per call.

    ``gate_up``, ``down``: this rank's pair from ``shard_mlp``, on the
    group's GPU. ``reduce_dtype`` and ``check_peers`` as for
    ``TensorParallelLinear``. ``mlp(x)``: ``x`` ``[..., H]`` fp16/bf16 on
    this GPU, the same on every rank; returns ``[..., H]``. To capture it in
    a CUDA graph keep ``mlp.buffers`` (what the captured call wrote) while
    the graph lives.
    """

    def __init__(self, gate_up: KbitWeight, down: KbitWeight, group, *,
                 reduce_dtype: str = "auto", check_peers: bool = True):
        self.gate_up = TensorParallelLinear(gate_up, "column", group, gather_output=False,
                                            check_peers=check_peers)
        self.down = TensorParallelLinear(down, "row", group, reduce_dtype=reduce_dtype,
                                         check_peers=check_peers)

    def __call__(self, x):
        h = self.gate_up(x)
        a = swiglu(h)
        y = self.down(a)
        self.buffers = (h, a, *self.down.buffers)
        return y


# --------------------------------------------------------------------------
# one process per GPU


def run_on_gpus(fn, n_gpus: int, *args, timeout_s: float = 1800.0) -> list:
    """``fn(group, *args)`` in ``n_gpus`` new processes, rank r on GPU r.

    The NCCL unique id is made here and passed to every process, which
    makes its ``NcclGroup`` (size ``n_gpus``) and calls ``fn``; ``fn`` and
    ``args`` must be picklable (a module-level function). Returns the ranks'
    return values in rank order. If a rank raises or dies, or ``timeout_s``
    passes, the other ranks (which may be waiting in a collective) are
    terminated and RuntimeError / TimeoutError names the rank and its error:
    no hang.
    """
    import multiprocessing
    import queue
    import time

    import cupy as cp

    n = _check_count(n_gpus)
    available = cp.cuda.runtime.getDeviceCount()
    if n > available:
        raise ValueError(f"n_gpus={n} but this machine has {available} GPUs")
    unique_id = new_unique_id()
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, n, unique_id, args, results),
                         name=f"kbit-rank-{r}") for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(n)) - out.keys())} did not finish "
                                   f"within {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} exited with code {dead[0][1]} before "
                                       "returning") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed: {value}")
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive() and len(out) < n:
                p.terminate()  # waiting for a peer that will never come
        for p in procs:
            p.join(timeout=60)
    return [out[r] for r in range(n)]


def _rank_main(fn, rank: int, size: int, unique_id: tuple, args: tuple, results) -> None:
    import traceback

    try:
        import cupy as cp

        cp.cuda.Device(rank).use()
        group = NcclGroup.create(unique_id, size, rank, rank)
        results.put((rank, True, fn(group, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the rest
        tail = traceback.format_exc(limit=-3)
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{tail}"))
