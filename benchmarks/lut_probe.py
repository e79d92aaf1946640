"""Prototype: k = 2 at M = 1 by table lookups of four products (lut_k2_probe.cu),
against kbit_gemm's own choice and the read ceiling, in one process.

The kernel reads FORMAT.md's (packed, absmax) directly (no tiled copy). Not
part of the package: a measurement of whether the form is worth building.
Correctness: relative Frobenius error against kbit_gemm(kernel="mma") and
against a float64 product on the smaller layers; timing: CUDA graphs after a
256 MB overwrite (harness.time_graph), the read ceiling from stream_probe.

    PYTHONPATH=. python benchmarks/lut_probe.py --compile-only          # offline: registers, spills
    PYTHONPATH=. python benchmarks/lut_probe.py --out benchmarks/results/lut_probe_h200_<commit>
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

SRC = Path(__file__).with_name("lut_k2_probe.cu")
LAYERS = ["8192x57344", "4096x28672", "14336x4096"]
CONFIGS = [(32, 8), (16, 8), (32, 4)]  # (S row steps a lane, G loads a group)
STAGED = [(32, 4, 4), (16, 4, 4), (32, 2, 6), (32, 8, 3)]  # (S, T CTA steps a stage, NSTAGE)
TILES = [(16, 4), (16, 2), (8, 4)]  # lut_k2_tiles: (S half-tile steps a warp, G), 64 S rows a CTA
TBAL = [(16, 2), (14, 2), (16, 4)]  # lut_k2_tiles_bal: the same, units spread evenly over 2 CTAs an SM
RING = [(16, 4), (16, 8), (16, 2)]  # lut_k2_ring: (S, D ring steps), cp.async prefetch
V4 = [(8, 4), (8, 2), (16, 2), (12, 4)]  # lut_k2_v4: (S whole-tile steps a warp, G), 128 S rows a CTA


def names(configs, staged=(), tiles=()):
    return ([f"lut_k2<{s}, {g}>" for s, g in configs]
            + [f"lut_k2_staged<{s}, {t}, {n}>" for s, t, n in staged]
            + [f"lut_k2_tiles<{s}, {g}>" for s, g in tiles]
            + [f"lut_k2_tiles_bal<{s}, {g}>" for s, g in TBAL]
            + [f"lut_k2_ring<{s}, {d}>" for s, d in RING]
            + [f"lut_k2_v4<{s}, {g}>" for s, g in V4] + ["lut_reduce", "lut_reduce_bal"])


def ring_smem(d: int) -> int:
    return 65536 + 1024 + 8 * d * 768


def staged_smem(t: int, nstage: int) -> int:
    return 65536 + 1024 + nstage * 32 * t * 72


def compile_only(configs, staged, tiles) -> int:
    from kbit_cupy import _jit

    for arch in ("sm_90a", "sm_80"):
        opts = [*_jit.compile_options(), "-ftz=true", "--ptxas-options=-v", f"-arch={arch}"]
        ok, log, lowered = _jit._nvrtc_compile(SRC.read_text(), names(configs, staged, tiles), opts)
        stats = _jit._parse_ptxas(log)
        print(arch, "ok" if ok else "FAILED")
        if not ok:
            print(log)
            return 1
        for n, mangled in lowered.items():
            print(f"  {n:<18} {stats.get(mangled)}")
    return 0


def lut_op(f, reduce_k, grid, smem, w, A, part, C, cps: int, chunks: int, packed, absmax):
    """The prototype's two launches as one op (partials, then their sum in split order)."""
    N, K_dim = w.shape
    args = (packed, absmax, w.codebook, A, part, np.int32(N), np.int32(K_dim), np.int32(cps),
            np.int32(chunks))

    def op():
        f(grid, (256,), args, shared_mem=smem)
        reduce_k(((N + 255) // 256,), (256,), (part, C, np.int32(N), np.int32(grid[1])))
        return C

    return op


def tiles_op(f, reduce_k, grid, smem, w, A, part, C, cps: int):
    """lut_k2_tiles on the weight's tiled layout, then the split sum."""
    N, K_dim = w.shape
    tiles, scales = w._tiles
    args = (tiles, scales, w.codebook, A, part, np.int32(N), np.int32(K_dim), np.int32(cps),
            np.int32(tiles.shape[1]), np.int32(tiles.shape[0]))

    def op():
        f(grid, (256,), args, shared_mem=smem)
        reduce_k(((N + 255) // 256,), (256,), (part, C, np.int32(N), np.int32(grid[1])))
        return C

    return op


def bal_op(f, reduce_bal, grid: int, smem, w, A, part, C, units: int, rows_per_rb: int):
    """lut_k2_tiles_bal on the weight's tiled layout, then the slot sum."""
    N, K_dim = w.shape
    tiles, scales = w._tiles
    kt_n = tiles.shape[1]
    args = (tiles, scales, w.codebook, A, part, np.int32(N), np.int32(K_dim), np.int32(kt_n),
            np.int32(tiles.shape[0]), np.int32(units))
    rargs = (part, C, np.int32(N), np.int32(rows_per_rb), np.int32(kt_n), np.int32(units), np.int32(grid))

    def op():
        f((grid,), (256,), args, shared_mem=smem)
        reduce_bal(((N + 255) // 256,), (256,), rargs)
        return C

    return op


def checked(ops: dict, layer: str, ref, exact, name: str, op, detail: str) -> None:
    """op's relative error against the mma kernel's ``ref`` and float64's
    ``exact`` (None: not computed), and whether a repeat gives the same bits,
    printed; op kept in ``ops`` under ``name``."""
    import cupy as cp

    got = op().astype(cp.float32)
    err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
    ex = (float(cp.linalg.norm(got.astype(cp.float64) - exact) / cp.linalg.norm(exact))
          if exact is not None else float("nan"))
    bits = bool(cp.array_equal(op(), op()))
    print(f"{layer} {name}: {detail}, rel err vs mma {err:.2e}, "
          f"vs float64 {ex:.2e}, repeat same bits {bits}", flush=True)
    ops[name] = op


def split_grid(row_blocks: int, k_units: int, sp: int, sms: int) -> tuple[int, int]:
    """(splits, K units a split) of ``k_units``: ``sp`` splits, or where 0
    enough that row_blocks x splits fills 2 CTAs an SM (at most one wave)."""
    if sp == 0:
        sp = max(1, (2 * sms) // row_blocks)
    cps = -(-k_units // min(sp, k_units))
    return -(-k_units // cps), cps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=LAYERS, help="K_dimxN")
    p.add_argument("--splits", nargs="+", type=int, default=[0], help="0: fill 2 CTAs an SM")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--define", action="append", default=[], help="-D for lut_k2_probe.cu (diagnostics)")
    p.add_argument("--only", nargs="+", default=None, help="time only ops whose name starts so")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.compile_only:
        return compile_only(CONFIGS, STAGED, TILES)

    import cupy as cp

    from kbit_cupy import _jit, kbit_gemm
    from kbit_cupy.bench import harness

    sys.path.insert(0, str(Path(__file__).parent))
    from latency_kernel import activations_and_cublas, layer_weights, run_info
    from stream_probe import read_ceilings

    info = run_info(harness)
    probe = cp.RawModule(code=SRC.read_text(), options=_jit.compile_options(),
                         name_expressions=["shared_base"]).get_function("shared_base")
    base = cp.zeros(1, cp.uint32)
    probe((1,), (1,), (base,), shared_mem=1024)
    table_at = int(base[0])
    print(f"dynamic shared memory starts at window offset {table_at}", flush=True)
    mod = cp.RawModule(code=SRC.read_text(), options=(*_jit.compile_options(), f"-DTABLE_AT={table_at}",
                                                        *(f"-D{d}" for d in args.define)),
                       name_expressions=names(CONFIGS, STAGED, TILES))
    chunk_major = "LUT_CHUNK_MAJOR=1" in args.define
    kerns = {cfg: mod.get_function(n) for cfg, n in zip(CONFIGS, names(CONFIGS))}
    if chunk_major:
        for cfg in STAGED:
            kerns[cfg] = mod.get_function(names((), [cfg])[0])
            kerns[cfg].max_dynamic_shared_size_bytes = staged_smem(cfg[1], cfg[2])
    reduce_k = mod.get_function("lut_reduce")
    smem = 65536 + 1024
    for cfg in CONFIGS:
        kerns[cfg].max_dynamic_shared_size_bytes = smem
    tkerns = {cfg: mod.get_function(names((), (), [cfg])[0]) for cfg in TILES}
    bkerns = {cfg: mod.get_function(f"lut_k2_tiles_bal<{cfg[0]}, {cfg[1]}>") for cfg in TBAL}
    vkerns = {cfg: mod.get_function(f"lut_k2_v4<{cfg[0]}, {cfg[1]}>") for cfg in V4}
    for f in vkerns.values():
        f.max_dynamic_shared_size_bytes = smem
    reduce_bal = mod.get_function("lut_reduce_bal")
    from kbit_cupy.gemm import launch_ctas_per_sm, lut_slots
    rkerns = {}
    for S, D in RING:
        f = mod.get_function(f"lut_k2_ring<{S}, {D}>")
        f.max_dynamic_shared_size_bytes = ring_smem(D)
        rkerns[(S, D)] = (f, launch_ctas_per_sm(f, 256, ring_smem(D)))
        print(f"lut_k2_ring<{S}, {D}>: {ring_smem(D)} B of shared memory, {rkerns[(S, D)][1]} CTAs an SM",
              flush=True)
    for f in (*tkerns.values(), *bkerns.values()):
        f.max_dynamic_shared_size_bytes = smem
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    records = []
    for layer in args.layers:
        K_dim, N, W, weights = layer_weights(layer, [2])
        w = weights[2]
        A, cublas = activations_and_cublas(W, 1, np.float16)
        ref = kbit_gemm(A, w, kernel="mma").astype(cp.float32)
        exact = None
        if N * K_dim <= 4096 * 28672:
            exact = (A.astype(cp.float64) @ w.dequantize(np.float32).astype(cp.float64).T)
        out_auto = cp.empty((1, N), cp.float16)
        ops = {"cublas_fp16": cublas,
               "auto": lambda w=w, A=A, o=out_auto: kbit_gemm(A, w, out=o)}
        chunks = -(-K_dim // 256)
        packed, absmax = w.packed, w.absmax
        if chunk_major:  # [chunk][row][8 blocks], blocks past K_dim zero, 16 B of padding
            assert N % 2 == 0, "the staged kernel copies two rows' scales at a time"
            kb = K_dim // 32
            pk = cp.zeros((N, chunks * 8, 2), cp.uint32)
            pk[:, :kb] = w.packed.reshape(N, kb, 2)
            am = cp.zeros((N, chunks * 8), cp.uint8)
            am[:, :kb] = w.absmax.reshape(N, kb)
            packed = cp.zeros(N * chunks * 16 + 4, cp.uint32)
            packed[:-4] = pk.reshape(N, chunks, 16).transpose(1, 0, 2).reshape(-1)
            absmax = cp.zeros(N * chunks * 8 + 16, cp.uint8)
            absmax[:-16] = am.reshape(N, chunks, 8).transpose(1, 0, 2).reshape(-1)
        for cfg, f in kerns.items():
            S = cfg[0]
            row_blocks = -(-N // (32 * S))
            for sp0 in args.splits:
                sp, cps = split_grid(row_blocks, chunks, sp0, sms)
                part = cp.full((sp, N), np.nan, cp.float32)
                C = cp.full((1, N), np.nan, cp.float16)
                op = lut_op(f, reduce_k, (row_blocks, sp), smem if len(cfg) == 2 else staged_smem(*cfg[1:]),
                            w, A, part, C, cps, chunks, packed, absmax)
                name = (f"lut S={S} G={cfg[1]} splits={sp}" if len(cfg) == 2
                        else f"staged S={S} T={cfg[1]} NST={cfg[2]} splits={sp}")
                checked(ops, layer, ref, exact, name, op, f"grid {row_blocks}x{sp}")
        rt_n, kt_n = w._tiles[0].shape[:2]
        for cfg, f in tkerns.items():
            S = cfg[0]
            row_blocks = -(-rt_n // (4 * S))
            sp, cps = split_grid(row_blocks, kt_n, 0, sms)
            part = cp.full((sp, N), np.nan, cp.float32)
            C = cp.full((1, N), np.nan, cp.float16)
            op = tiles_op(f, reduce_k, (row_blocks, sp), smem, w, A, part, C, cps)
            checked(ops, layer, ref, exact, f"tiles S={S} G={cfg[1]} splits={sp}", op,
                    f"grid {row_blocks}x{sp}")
        # the balanced forms: (kernel, CTAs an SM, shared bytes, row tiles a row block, name)
        balanced = ([(f, 2, smem, 4 * S, f"balanced S={S} G={G}") for (S, G), f in bkerns.items()]
                    + [(f, 2, smem, 8 * S, f"v4 S={S} G={G}") for (S, G), f in vkerns.items()]
                    + [(f, per_sm, ring_smem(D), 4 * S, f"ring S={S} D={D}")
                       for (S, D), (f, per_sm) in rkerns.items()])
        for f, per_sm, shared, rb_tiles, label in balanced:
            n_rb = -(-rt_n // rb_tiles)
            units = n_rb * kt_n
            grid = min(per_sm * sms, units)
            slots = lut_slots(n_rb, kt_n, grid)
            part = cp.full((slots, N), np.nan, cp.float32)
            C = cp.full((1, N), np.nan, cp.float16)
            op = bal_op(f, reduce_bal, grid, shared, w, A, part, C, units, 16 * rb_tiles)
            checked(ops, layer, ref, exact, f"{label} ctas={grid}", op, f"{units} units, {slots} slots")
        cp.cuda.Device().synchronize()
        read = read_ceilings(K_dim, N, [2], args.reps)[2]
        base = None
        for name, op in ops.items():
            if args.only and name not in ("cublas_fp16", "auto") and not name.startswith(tuple(args.only)):
                continue
            st = harness.time_graph(op, reps=args.reps)
            t = st["median_us"] if st else float("nan")
            base = t if name == "cublas_fp16" else base
            rec = {"K_dim": K_dim, "N": N, "M": 1, "k": 2, "op": name, "graph_us": t,
                   "speedup": base / t, "read_us": read, "read_share": read / t}
            records.append(rec)
            print(f"{layer} {name:<28} {t:8.2f} us {base / t:5.2f}x  read share {read / t:.3f}",
                  flush=True)
        del weights, w, W
    if args.out:
        meta = {**info, "method": "CUDA graphs of (256 MB overwrite, op) pairs minus overwrites, "
                "median of 10 replays of reps pairs (harness.time_graph); read_us: stream_probe "
                "read_ceilings of the layer's k = 2 bytes", "reps": args.reps}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["K_dim", "N", "M", "k", "op", "graph_us", "speedup",
                                       "read_us", "read_share"],
                              title="k = 2, M = 1: table-lookup prototype (lut_k2_probe.cu)")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
