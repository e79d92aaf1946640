"""Where the routing launch's time goes: phase stamps inside moe_route.cu (device only).

Builds kernels_src/moe_route.cu with -DKBIT_ROUTE_PHASES and launches it as
route_pairs does, after a 256 MB overwrite (cold L2, as the TARGETS.md
method), then reads the stamps (global timer, the latest warp at each point):
0 entry, 1 counts done (before the barrier), 4 per-thread sums done, 5 scan
done, 2 offsets and first slots written, 3 placement done, 6 the staged
order written out. Printed: medians
over the launches, us since entry.

usage: PYTHONPATH=. python benchmarks/route_phases.py [--cases 128:256 128:4096 ...]
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["128:256", "128:1024", "128:4096", "128:16384",
                                                  "512:5120", "8:1024"],
                   metavar="EXPERTS:PAIRS")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warm", action="store_true",
                   help="no overwrite before each launch (the kernel's code, parameters and ids "
                        "stay in L2 from the launch before)")
    p.add_argument("--unstaged", dest="staged", action="store_false",
                   help="the ids and the order straight from and to memory, not staged in "
                        "shared memory")
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy import _jit, experts
    from kbit_cupy.bench import harness

    name = _jit.kernel_name("moe_route", _jit.MOE_ROUTE_THREADS)
    module = cp.RawModule(code=_jit.render_source("moe_route"),
                          options=(*_jit.compile_options(), "-DKBIT_ROUTE_PHASES"),
                          name_expressions=[name])
    kern = module.get_function(name)
    stamps = cp.ndarray((8,), cp.uint64, module.get_global("kbit_route_stamps"))
    flush = cp.empty(256 << 20, cp.uint8)
    print(f"{harness.gpu_info()['gpu']}: moe_route.cu phases, us since entry (median of "
          f"{args.reps}, {'warm' if args.warm else 'after a 256 MB overwrite'}, "
          f"{'staged' if args.staged else 'unstaged'})")
    print(f"{'experts':>7} {'pairs':>6} {'counted':>8} {'summed':>7} {'scanned':>8} {'slots':>6} "
          f"{'placed':>7} {'written':>7}")
    rng = np.random.default_rng(0)
    for case in args.cases:
        E, pairs = (int(v) for v in case.split(":"))
        ids = cp.asarray(rng.integers(0, E, pairs).astype(np.int32))
        warps, staged, shared = experts._route_geometry(kern, E, pairs, args.staged)
        offsets = cp.empty(E + 1, cp.int32)
        order = cp.empty(pairs, cp.int32)
        rows = []
        for _ in range(args.reps):
            if not args.warm:
                flush.fill(1)
            stamps.fill(0)
            kern((1,), (_jit.MOE_ROUTE_THREADS,),
                 (ids, np.int32(pairs), np.int32(E), np.int32(warps), offsets, order,
                  np.int32(staged)),
                 shared_mem=shared)
            cp.cuda.Device().synchronize()
            s = cp.asnumpy(stamps).astype(np.int64)
            rows.append([(s[i] - s[0]) / 1e3 for i in (1, 4, 5, 2, 3, 6)])
        m = np.median(np.array(rows), axis=0)
        print(f"{E:>7} {pairs:>6} " + " ".join(f"{v:>7.2f}" for v in m), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
