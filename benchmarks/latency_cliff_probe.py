"""Is the latency kernel's time a property of the point, or of the run?

    PYTHONPATH=.:benchmarks python benchmarks/latency_cliff_probe.py \
        --layer 4096x12288 --k 2 --m 1 2 3 4 --allocs 3 --out benchmarks/results/<name>

The dispatch audit (dispatch_audit.py) found the latency kernel at
4096x12288 k = 2 taking 12.40 / 19.10 / 13.50 us at 2 / 3 / 4 rows, one
modelled launch geometry at all three, and 5120x13824 k = 2 at one row 15.6
us in one run and 23.6 in another. (The cause, found with this probe ruling
out the addresses: the occupancy cache keyed without the threads, fixed at
8aae053; occupancy_cache_replay.py.) This probe times the same points again, several
times, each time on a freshly quantized copy of the weight placed behind a
pad of a different size (so its packed tiles start at another address), and
writes per timing the launch (grid, block, shared bytes) and where the
weight's tiles lie (the address modulo 2 MiB). Kernel-only (harness.time_graph,
the TARGETS.md method); mma is timed beside each as the reference.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer", required=True, help="K_dimxN")
    p.add_argument("--k", nargs="+", type=int, default=[2])
    p.add_argument("--m", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--allocs", type=int, default=3, help="fresh copies of the weight")
    p.add_argument("--repeat", type=int, default=2, help="timings of each point on one copy")
    p.add_argument("--kernels", nargs="+", default=["latency", "mma"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--a-offsets", type=int, default=0,
                   help="instead of fresh weights: this many places of A (512-byte aligned, "
                        "random within --a-span-mib of one buffer), one copy of the weight")
    p.add_argument("--a-span-mib", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import cupy as cp
    from latency_kernel import layer_weights, run_info

    from kbit_cupy import gemm, kbit_gemm
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    info = run_info(harness)
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    records = []
    if args.a_offsets:
        records = a_places(args, dtype, layer_weights, kbit_gemm, harness)
        args.allocs = 0
    pad_rng = np.random.default_rng(7)
    for alloc in range(args.allocs):
        # a pad of 0..63 MiB in 4 KiB steps before the weight's buffers
        pad = cp.empty(int(pad_rng.integers(0, 16384)) * 4096 + 4096, np.uint8)
        K_dim, N, _W, weights = layer_weights(args.layer, args.k)
        del _W
        for k, w in weights.items():
            tiles_ptr = int(w._tiles[0].data.ptr)
            for M in args.m:
                A = cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
                launch = gemm._plan_latency_launch(M, w, dtype) if "latency" in args.kernels else None
                for rep in range(args.repeat):
                    line = []
                    for kern in args.kernels:
                        out = cp.empty((M, N), dtype)
                        kbit_gemm(A, w, out=out, kernel=kern)
                        st = harness.time_graph(lambda w=w, kern=kern, A=A, out=out:
                                                kbit_gemm(A, w, out=out, kernel=kern), reps=args.reps)
                        if not st:
                            continue
                        rec = {"layer": args.layer, "k": k, "M": M, "dtype": args.dtype, "alloc": alloc,
                               "rep": rep, "kernel": kern, "graph_us": st["median_us"],
                               "p10_us": st["p10_us"], "p90_us": st["p90_us"],
                               "tiles_mod_2MiB": tiles_ptr % (2 << 20), "pad_bytes": pad.nbytes}
                        if kern == "latency" and launch is not None:
                            rec.update(grid=launch.grid[0], block=launch.block[0], shared=launch.shared)
                        records.append(rec)
                        line.append(f"{kern}={st['median_us']:.2f} [{st['p10_us']:.2f}..{st['p90_us']:.2f}]")
                    geo = (f"grid {launch.grid[0]} block {launch.block[0]} smem {launch.shared}"
                           if launch is not None else "")
                    print(f"alloc {alloc} rep {rep} k={k} M={M:<3} tiles%2MiB={tiles_ptr % (2 << 20):>8} "
                          f"{geo}  " + " ".join(line), flush=True)
                del A
        del weights, pad
        cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        harness.write_results(records, {**info, "method": "CUDA graphs after the 256 MB overwrite, "
                                        f"median of 10 replays of {args.reps} pairs"},
                              f"{args.out}.json", f"{args.out}.md",
                              columns=(["layer", "k", "M", "dtype", "kernel", "graph_us", "a_offset",
                                        "a_ptr_mod_2MiB"] if args.a_offsets else
                                       ["layer", "k", "M", "dtype", "alloc", "rep", "kernel", "graph_us",
                                        "p10_us", "p90_us", "tiles_mod_2MiB"]),
                              title="the latency kernel's time, fresh copies of the weight")
    return 0


def a_places(args, dtype, layer_weights, kbit_gemm, harness) -> list[dict]:
    """The same points with A's row(s) at ``args.a_offsets`` places of one
    buffer (the weight fixed): whether A's address decides the time."""
    import cupy as cp

    K_dim, N, _W, weights = layer_weights(args.layer, args.k)
    del _W
    span = args.a_span_mib << 20
    buf = cp.empty(span + (max(args.m) * K_dim * dtype.itemsize), np.uint8)
    rng = np.random.default_rng(11)
    offsets = sorted(int(o) * 512 for o in rng.choice(span // 512, args.a_offsets, replace=False))
    records = []
    for M in args.m:
        nbytes = M * K_dim * dtype.itemsize
        src = cp.random.default_rng(1).standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
        for off in offsets:
            A = buf[off:off + nbytes].view(dtype).reshape(M, K_dim)
            A[...] = src
            line = []
            for k, w in weights.items():
                for kern in args.kernels:
                    out = cp.empty((M, N), dtype)
                    kbit_gemm(A, w, out=out, kernel=kern)
                    st = harness.time_graph(lambda w=w, kern=kern, A=A, out=out:
                                            kbit_gemm(A, w, out=out, kernel=kern), reps=args.reps)
                    records.append({"layer": args.layer, "k": k, "M": M, "dtype": args.dtype,
                                    "kernel": kern, "graph_us": st["median_us"], "a_offset": off,
                                    "a_ptr_mod_2MiB": int(A.data.ptr) % (2 << 20)})
                    line.append(f"k={k} {kern}={st['median_us']:.2f}")
            print(f"M={M:<3} A at +{off:>9} (%2MiB {int(A.data.ptr) % (2 << 20):>8})  " + " ".join(line),
                  flush=True)
    return records


if __name__ == "__main__":
    raise SystemExit(main())
