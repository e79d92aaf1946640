"""The grouped launch's problem size: mma.sync against the Hopper path at each
n8-tile count, in one process (device only).

For each config (moe_vs_grouped_mm.py's) and T tokens: a seeded uniform
router (each token's top-k distinct experts), the (token, choice) rows
grouped by expert (stable) outside the timing, and ``kbit_grouped_gemm`` timed kernel-only
(``harness.time_graph``: a CUDA graph of (256 MB overwrite, op) pairs minus
the overwrites) with the launch forced onto:

- ``auto``: what the package picks;
- ``mma``: mma.sync (``experts._GROUPED_WG = False``), its own problem size;
- ``wgN``: the Hopper path with problems of 8 * N rows
  (``_jit.GEMM_GROUPED_WG_M_TILES = (N,)``); ``wgNxW`` with W warpgroups per
  CTA (``experts._GROUPED_WG_WARPGROUPS``).

Each variant is a shallow copy of one prepared KbitExperts with its own plan
cache, so every plan is made under its variant's settings. Results are
compared with ``auto``'s (relative Frobenius error: the problems, and so the
order of the fp32 sums, differ between variants).

    PYTHONPATH=. python benchmarks/moe_mtiles_ab.py --configs e128_top8_2048x1536 --t 128 512
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_vs_grouped_mm import CONFIGS


def random_experts(E: int, N: int, K_dim: int):
    """E experts of [N, K_dim] fp16 weights (standard normal x 0.02, seed 0),
    quantized at k = 4 and prepared (the device synchronized after)."""
    import cupy as cp

    from kbit_cupy import quantize_experts

    W = (cp.random.default_rng(0).standard_normal((E, N, K_dim), dtype=cp.float32)
         * np.float32(0.02)).astype(cp.float16)
    experts = quantize_experts(W, k=4).prepare()
    del W
    cp.cuda.Device().synchronize()
    return experts


def uniform_routed_rows(rng, E: int, top_k: int, K_dim: int, T: int, dtype):
    """T tokens of a uniform router (each token's top_k distinct experts, from
    ``rng``): (offsets [E + 1] int32 and A [T * top_k, K_dim] of ``dtype``,
    the (token, choice) rows grouped by expert, stable), both on the device."""
    import cupy as cp

    ids = np.stack([rng.choice(E, top_k, replace=False) for _ in range(T)]).reshape(-1)
    counts = np.bincount(ids, minlength=E)
    order = np.argsort(ids, kind="stable")
    offsets = cp.asarray(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    x = rng.standard_normal((T, K_dim)).astype(np.float32)
    return offsets, cp.asarray(x[order // top_k]).astype(dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--t", nargs="+", type=int, default=[128, 256, 384, 512])
    p.add_argument("--wg", nargs="+", default=["2", "4", "6", "8"],
                   help="n8 tiles per problem of the Hopper path variants; TxW: T tiles with W "
                        "warpgroups per CTA (default: _jit.gemm_grouped_wg_warpgroups)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy import _jit, kbit_grouped_gemm
    from kbit_cupy import experts as ex
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = harness.gpu_info()
    print(f"{info['gpu']}  commit {os.environ.get('KBIT_COMMIT', info.get('commit'))}  "
          f"k=4 {args.dtype}, kernel-only", flush=True)
    saved_tiles = _jit.GEMM_GROUPED_WG_M_TILES

    def forced(fn, wg, tiles, wgs=None):
        def op():
            ex._GROUPED_WG, _jit.GEMM_GROUPED_WG_M_TILES = wg, tiles
            ex._GROUPED_WG_WARPGROUPS = wgs
            try:
                return fn()
            finally:
                ex._GROUPED_WG, _jit.GEMM_GROUPED_WG_M_TILES = None, saved_tiles
                ex._GROUPED_WG_WARPGROUPS = None
        return op

    for name in args.configs:
        E, top_k, N, K_dim, _ = CONFIGS[name]
        rng = np.random.default_rng(0)
        base = random_experts(E, N, K_dim)
        for T in args.t:
            offsets, A = uniform_routed_rows(rng, E, top_k, K_dim, T, dtype)
            counts = np.diff(cp.asnumpy(offsets))  # rows per expert
            R = T * top_k
            variants = {"auto": (None, saved_tiles, None), "mma": (False, saved_tiles, None)}
            for spec in args.wg:
                t, _, w = spec.partition("x")
                variants[f"wg{spec}"] = (True, (int(t),), int(w) if w else None)
            ops, outs = {}, {}
            for vname, (wg, tiles, wgs) in variants.items():
                w = copy.copy(base)
                w._plans = {}
                C = cp.empty((R, N), dtype)
                op = forced(lambda w=w, C=C, A=A, offsets=offsets: kbit_grouped_gemm(
                    A, w, offsets, out=C, validate=False), wg, tiles, wgs)
                try:
                    outs[vname] = op().astype(cp.float32)
                except Exception as e:  # noqa: BLE001 - a variant that cannot launch
                    print(f"{name} T={T} {vname}: {type(e).__name__}: {e}", flush=True)
                    continue
                ops[vname] = op
            cp.cuda.Device().synchronize()
            ref = outs["auto"]
            act = int((counts > 0).sum())
            print(f"{name} T={T}: {act} experts with rows, rows per expert mean "
                  f"{R / max(act, 1):.1f} max {counts.max()}", flush=True)
            for vname, op in ops.items():
                err = float(cp.linalg.norm(outs[vname] - ref) / cp.linalg.norm(ref))
                st = harness.time_graph(op, reps=args.reps)
                t = st["median_us"] if st else float("nan")
                print(f"  {vname:<6} {t:9.2f} us   rel err vs auto {err:.1e}", flush=True)
        del base
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
