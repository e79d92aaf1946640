"""gemm_latency.cu's cluster split (kernel="cluster") against cuBLAS fp16,
kernel="auto", mma, latency and dequantize + cuBLAS, kernel-only, over its
geometries (row tiles per CTA, n8 tiles per M chunk, CTAs per cluster).

Every op is timed as a CUDA graph of (256 MB L2 flush, op) pairs minus a
graph of flushes (``harness.time_graph``, the TARGETS.md method); cuBLAS
through its capturable form (``_launch.cublas_gemm``), our kernels through
the public ``kbit_gemm`` call with ``out=``. One process. A geometry is set
through gemm.py's module attributes (``_CLUSTER_ROW_TILES``,
``_CLUSTER_M_TILES``, ``_CLUSTER_RANKS``; 0: cluster_geometry's choice) while
the op's plan is made. Before timing, each result is compared with the mma
kernel's (relative Frobenius error; the GPU tests are the correctness gate).

    PYTHONPATH=. python benchmarks/cluster_split.py --out benchmarks/results/cluster_h100_<commit>
"""

from __future__ import annotations

import argparse
import os

import numpy as np

LAYERS = ["2048x768", "768x2048", "2048x512", "4096x4096"]
# (name, row tiles per CTA, n8 tiles per M chunk, ranks); 0: the default choice
GEOMETRIES = [("cluster", 0, 0, 0), ("cl_r1", 1, 0, 0), ("cl_r2", 2, 0, 0), ("cl_r4", 4, 0, 0),
              ("cl_r8", 8, 0, 0), ("cl_m2", 0, 2, 0), ("cl_m4", 0, 4, 0), ("cl_m8", 0, 8, 0)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=LAYERS, help="K_dimxN")
    p.add_argument("--m", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--k", nargs="+", type=int, default=[2, 4])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--geometries", nargs="+", default=[g[0] for g in GEOMETRIES])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy import gemm, kbit_gemm
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    sys_path_benchmarks()
    from define_ab import module_attributes
    from latency_kernel import activations_and_cublas, layer_weights, run_info

    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = run_info(harness)
    geometries = [g for g in GEOMETRIES if g[0] in args.geometries]
    records = []
    for layer in args.layers:
        K_dim, N, W, weights = layer_weights(layer, args.k)
        rt_n, kt_n = gemm._tile_counts(N, K_dim)
        for M in args.m:
            A, cublas = activations_and_cublas(W, M, dtype)
            base = _time(harness, cublas, args.reps)
            records.append(_record(K_dim, N, M, 16, "cublas", "", args.dtype, base, base))
            print(f"{K_dim:>5}x{N:<5} M={M:<4} cublas_fp16 {base:8.2f} us", flush=True)
            for k, w in weights.items():
                ref = kbit_gemm(A, w, kernel="dequant").astype(cp.float32)
                ops = [("auto", "auto", {}), ("dequant", "dequant", {})]
                if M <= 64:
                    ops.append(("mma", "mma", {}))
                if M <= gemm._latency_rows(K_dim, dtype.itemsize):
                    ops.append(("latency", "latency", {}))
                for name, per_cta, m_tiles, ranks in geometries:
                    ops.append((name, "cluster", {"gemm._CLUSTER_ROW_TILES": per_cta,
                                                  "gemm._CLUSTER_M_TILES": m_tiles,
                                                  "gemm._CLUSTER_RANKS": ranks}))
                line = []
                for name, kern, attrs in ops:
                    w._plans = {}
                    out = cp.empty((M, N), dtype)
                    with module_attributes(attrs):
                        geom = ""
                        if kern == "cluster":
                            g = gemm.cluster_geometry(M, rt_n, kt_n, gemm._sm_count())
                            geom = "m{}/ranks{}/rt{}/w{}".format(*g)
                        try:
                            got = kbit_gemm(A, w, out=out, kernel=kern).astype(cp.float32)
                        except ValueError as e:
                            print(f"  {name}: {e}", flush=True)
                            continue
                        err = float(cp.linalg.norm(got - ref) / max(float(cp.linalg.norm(ref)), 1e-30))
                        if err > (2e-3 if dtype == np.float16 else 1e-2):
                            print(f"  MISMATCH {layer} M={M} k={k} {name}: {err:.2e}", flush=True)
                        t = _time(harness, lambda w=w, kern=kern, A=A, out=out:
                                  kbit_gemm(A, w, out=out, kernel=kern), args.reps)
                    records.append(_record(K_dim, N, M, k, name, geom, args.dtype, t, base))
                    line.append(f"{name} {base / t:4.2f}")
                print(f"{K_dim:>5}x{N:<5} M={M:<4} k={k} " + "  ".join(line), flush=True)
        del weights
    if args.out:
        meta = {**info, "method": "CUDA graphs: (256 MB flush, op) pairs minus flushes, median "
                "of 10 replays of 20 pairs; cuBLAS fp16 through _launch.cublas_gemm"}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["K_dim", "N", "M", "k", "kernel", "geometry", "dtype",
                                       "graph_us", "speedup"],
                              title="cluster split vs the other kernels vs cuBLAS fp16 (kernel-only)")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0


def sys_path_benchmarks() -> None:
    """define_ab and latency_kernel (this folder) importable when run as a script from the root."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)


def _time(harness, op, reps: int) -> float:
    st = harness.time_graph(op, reps=reps)
    return st["median_us"] if st else float("nan")


def _record(K_dim, N, M, k, kernel, geometry, dtype, t, base) -> dict:
    return {"K_dim": K_dim, "N": N, "M": M, "k": k, "kernel": kernel, "geometry": geometry,
            "dtype": dtype, "graph_us": t, "speedup": base / t}


if __name__ == "__main__":
    raise SystemExit(main())
