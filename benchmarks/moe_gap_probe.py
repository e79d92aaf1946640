"""Where moe_linear's time over kbit_grouped_gemm goes (issue 21: within 15%).

Kernel-only (CUDA graphs, cold L2, harness.time_graph), k=4 (--k; --dense: k=4 only), fp16, 128
experts of [1536, 2048], top-8, T tokens (8T rows):
- grouped: kbit_grouped_gemm on rows already grouped by expert;
- gather: the same launch with the rows read and written through an
  identity ``row_ids`` table (ids_per_row = 1): the indirection alone;
- gather/8: through ``row_ids`` with ids_per_row = 8 (A has T rows, as in
  moe_linear): the indirection and the division;
- moe_linear (validate=False): routing launch + the grouped launch;
- route only: the routing launch (kernels_src/moe_route.cu) alone.
Usage: PYTHONPATH=. python benchmarks/moe_gap_probe.py [--t 128 512] [--ab KBIT_CROW_CHUNK=1]
       (--ab gemm._LATENCY_WARP_STEP=1: a module attribute of kbit_cupy instead of a -D)
"""

from __future__ import annotations

import argparse

import numpy as np

from kbit_cupy._arrays import BFLOAT16

ACT = np.dtype(np.float16)  # the activations' dtype (--dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t", nargs="+", type=int, default=[128, 512])
    p.add_argument("--k", type=int, default=4, choices=[2, 3, 4, 5], help="bits per weight")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--shape", default="2048x1536", help="K_dimxN")
    p.add_argument("--wg-m-tiles", type=int, nargs="+", default=None,
                   help="the grouped Hopper path's n8 tiles per problem to choose from "
                        "(default: _jit.GEMM_GROUPED_WG_M_TILES)")
    p.add_argument("--wg-ab", action="store_true",
                   help="instead: kbit_grouped_gemm and moe_linear with the grouped launch "
                        "forced onto mma.sync and onto the Hopper path (wgmma)")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="compile the kernels with -DNAME=VALUE (A/B of a kernel knob across runs)")
    p.add_argument("--dense", action="store_true",
                   help="instead: kbit_grouped_gemm against kbit_gemm on a dense layer of the "
                        "touched experts' bytes (their N rows stacked) at M = 1 and at the most "
                        "rows an expert has, and the read ceiling of those bytes (stream_probe.py)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                   help="the activations' dtype (the experts are quantized from fp16 either way)")
    p.add_argument("--ab", default=None, metavar="NAME=VALUE",
                   help="instead: kbit_grouped_gemm and moe_linear built with the default "
                        "options and with -DNAME=VALUE (or with module.ATTR=VALUE set), timed side "
                        "by side in this process")
    args = p.parse_args()
    if args.dense and args.k != 4:
        p.error("--dense compares against k = 4 dense layers only: leave --k at 4")
    global ACT
    ACT = np.dtype(BFLOAT16 if args.dtype == "bfloat16" else np.float16)

    import cupy as cp

    if args.define:
        from kbit_cupy import _jit

        saved = _jit.compile_options
        _jit.compile_options = lambda: (*saved(), *(f"-D{d}" for d in args.define))

    from kbit_cupy import quantize_experts
    from kbit_cupy.bench import harness

    if args.wg_m_tiles:
        from kbit_cupy import _jit

        _jit.GEMM_GROUPED_WG_M_TILES = tuple(args.wg_m_tiles)
    K_dim, N = (int(v) for v in args.shape.split("x"))
    E, top_k = args.experts, args.top_k
    rng = np.random.default_rng(0)
    W = cp.asarray((rng.standard_normal((E, N, K_dim)) * 0.02).astype(np.float16))
    experts = quantize_experts(W, k=args.k).prepare()
    experts_wg = quantize_experts(W, k=args.k).prepare() if args.wg_ab else None  # own plans
    del W
    cp.cuda.Device().synchronize()
    print(f"{harness.gpu_info()['gpu']}: {E} experts of [{N}, {K_dim}], top-{top_k}, k={args.k} {ACT.name}")
    for T in args.t:
        if args.ab:
            _define_ab(T, E, top_k, K_dim, N, experts, args.ab, rng)
            continue
        if args.dense:
            _dense(T, E, top_k, K_dim, N, experts, rng)
            continue
        if args.wg_ab:
            _wg_ab(T, E, top_k, K_dim, N, experts, experts_wg, rng)
        else:
            _probe(T, E, top_k, K_dim, N, experts, rng)
    return 0


def _time_and_print(T, ops, rounds: int = 4):
    """Each op as a CUDA graph (harness.time_graph), printed against the first:
    a discarded warm-up of every op, then ``rounds`` rounds of 10 reps each,
    the ops' order rotated per round, the median of an op's round medians.
    (Timed one op after the other, 20 reps each, the first ops of a T = 1 run
    on the H200 came out up to 13% slower than the same kernel timed later in
    the process: moe_gap_probe_h200_start_from_scan_d9f468d.txt.)"""
    from kbit_cupy.bench import harness

    names = list(ops)
    for name in names:
        harness.time_graph(ops[name], reps=3)
    got = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            st = harness.time_graph(ops[name], reps=10)
            got[name].append(st["median_us"] if st else float("nan"))
    base = None
    for name in names:
        t = float(np.median(got[name]))
        base = base or t
        print(f"T={T:<4} {name:<17} {t:8.2f} us  {t / base:5.3f}x the first", flush=True)


def _routed(T, E, top_k, K_dim, rng):
    """A seeded router's ids, the tokens, the group offsets and the rows
    grouped by expert (stable), as device arrays."""
    import cupy as cp

    ids = cp.asarray(np.stack([rng.choice(E, top_k, replace=False) for _ in range(T)])
                     .astype(np.int32))
    x = cp.asarray(rng.standard_normal((T, K_dim)).astype(ACT))
    flat = cp.asnumpy(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = cp.asarray(np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
                         .astype(np.int32))
    return ids, x, offsets, cp.asarray(cp.asnumpy(x)[order // top_k])


def _dense(T, E, top_k, K_dim, N, experts, rng):
    """kbit_grouped_gemm on T routed tokens against the same bytes as one dense
    layer (the touched experts' rows stacked, random weights) through kbit_gemm
    at M = 1 and at the largest rows per expert, and against the fastest read of
    those bytes; each a CUDA graph, printed."""
    import cupy as cp
    from stream_probe import read_ceilings

    from kbit_cupy import kbit_gemm, kbit_grouped_gemm, quantize_weight

    _, _, offsets, A_sorted = _routed(T, E, top_k, K_dim, rng)
    counts = np.diff(cp.asnumpy(offsets))
    active, most = int((counts > 0).sum()), int(counts.max())
    C = cp.empty((T * top_k, N), ACT)
    ops = {"grouped": lambda: kbit_grouped_gemm(A_sorted, experts, offsets, out=C, validate=False)}
    W = (cp.random.default_rng(2).standard_normal((active * N, K_dim), dtype=cp.float32)
         * np.float32(0.02)).astype(cp.float16)
    w = quantize_weight(W, k=4).prepare()
    del W
    for M in sorted({1, most}):
        A = cp.asarray(rng.standard_normal((M, K_dim)).astype(ACT))
        out = cp.empty((M, active * N), ACT)
        ops[f"dense M={M}"] = lambda A=A, out=out: kbit_gemm(A, w, out=out)
    cp.cuda.Device().synchronize()
    read = read_ceilings(K_dim, active * N, [4], 10)[4]
    print(f"T={T}: {active} experts touched, at most {most} rows; dense layer {K_dim}x{active * N}; "
          f"read of its k=4 bytes {read:.2f} us", flush=True)
    _time_and_print(T, ops)


def _wg_ab(T, E, top_k, K_dim, N, experts, experts_wg, rng):
    """The grouped launch on mma.sync against the Hopper path, both results
    compared (relative error), each op a CUDA graph; printed."""
    import cupy as cp

    from kbit_cupy import experts as ex
    from kbit_cupy import kbit_grouped_gemm, moe_linear

    ids, x, offsets, A_sorted = _routed(T, E, top_k, K_dim, rng)
    outs = {}

    def forced(fn, wg):
        def op():
            ex._GROUPED_WG = wg  # plans are per stream: the timing stream's is made on its first call
            try:
                return fn()
            finally:
                ex._GROUPED_WG = None
        return op

    ops = {}
    for name, w, wg in (("mma", experts, False), ("wgmma", experts_wg, True)):
        C = cp.empty((T * top_k, N), ACT)
        out3 = cp.empty((T, top_k, N), ACT)
        ops[f"grouped {name}"] = forced(
            lambda w=w, C=C: kbit_grouped_gemm(A_sorted, w, offsets, out=C, validate=False), wg)
        ops[f"moe_linear {name}"] = forced(
            lambda w=w, out3=out3: moe_linear(x, ids, w, out=out3, validate=False), wg)
    for name, op in ops.items():
        outs[name] = op().astype(cp.float32).reshape(T * top_k, N)
    for kind in ("grouped", "moe_linear"):
        a, b = outs[f"{kind} mma"], outs[f"{kind} wgmma"]
        err = float(cp.linalg.norm(a - b) / cp.linalg.norm(a))
        print(f"T={T:<4} {kind}: wgmma against mma, relative error {err:.2e}", flush=True)
    _time_and_print(T, ops)


def _holding(values: dict, fn):
    """fn() with each ``module.ATTR`` of ``values`` set (define_ab.module_attributes,
    no cache cleared: the plans were made under the same values)."""
    from define_ab import module_attributes

    with module_attributes(values, clear=False):
        return fn()


def _define_ab(T, E, top_k, K_dim, N, experts, define, rng):
    """kbit_grouped_gemm and moe_linear with the default kernels and with the
    kernels compiled with -D``define``, each plan made on the timing stream
    under its own options (a shallow copy of the experts holds it), results
    compared bit for bit, each op a CUDA graph; printed."""
    import copy

    import cupy as cp
    from define_ab import kernels_built_with, module_attributes

    from kbit_cupy import kbit_grouped_gemm, moe_linear
    from kbit_cupy.bench import harness

    ids, x, offsets, A_sorted = _routed(T, E, top_k, K_dim, rng)
    ops, outs = {}, {}
    # NAME=VALUE[,NAME=VALUE]: a dotted name is a module attribute of kbit_cupy, not a -D
    pairs = [kv.partition("=")[::2] for kv in define.split(",")]
    attrs = {n: v for n, v in pairs if "." in n}
    defines = tuple(f"-D{n}={v}" for n, v in pairs if "." not in n)
    for label, opts in (("default", ()), (define, defines)):
        w = copy.copy(experts)
        w._plans = {}
        C = cp.empty((T * top_k, N), ACT)
        out3 = cp.empty((T, top_k, N), ACT)
        held = {} if label == "default" else attrs
        # (a module attribute read at call time, such as experts._FUSED_ROUTE_MAX_PAIRS,
        # is held through every call of the variant's ops, captures included)
        pair = {f"grouped {label}": lambda w=w, C=C, held=held: _holding(held, lambda: kbit_grouped_gemm(
                    A_sorted, w, offsets, out=C, validate=False)),
                f"moe_linear {label}": lambda w=w, out3=out3, held=held: _holding(held, lambda: moe_linear(
                    x, ids, w, out=out3, validate=False))}
        with (kernels_built_with(opts), module_attributes({} if label == "default" else attrs),
              harness._bench_stream()):
            for name, op in pair.items():  # plans are per stream: made here, with these kernels
                outs[name] = op().copy()
            cp.cuda.Device().synchronize()
        ops.update(pair)
    for kind in ("grouped", "moe_linear"):
        same = bool((outs[f"{kind} default"].view(cp.uint16)
                     == outs[f"{kind} {define}"].view(cp.uint16)).all())
        a = outs[f"{kind} default"].astype(cp.float32)
        err = float(cp.linalg.norm(a - outs[f"{kind} {define}"].astype(cp.float32)) / cp.linalg.norm(a))
        print(f"T={T:<4} {kind}: {'the same bits' if same else 'DIFFERENT bits'} "
              f"(relative difference {err:.2e})", flush=True)
    _time_and_print(T, ops)


def _probe(T, E, top_k, K_dim, N, experts, rng):
    """The four ops at T tokens, each timed as a CUDA graph; printed."""
    import cupy as cp

    from kbit_cupy import experts as ex
    from kbit_cupy import kbit_grouped_gemm, moe_linear

    R = T * top_k
    ids, x, offsets, A_sorted = _routed(T, E, top_k, K_dim, rng)
    C = cp.empty((R, N), ACT)
    ident = cp.arange(R, dtype=cp.int32)
    A_rows = cp.ascontiguousarray(A_sorted)  # R rows: gather through the identity
    x_tok = cp.asarray(cp.asnumpy(A_sorted)[::top_k])  # T rows: row g // 8
    out3 = cp.empty((T, top_k, N), ACT)
    ops = {
        "grouped": lambda: kbit_grouped_gemm(A_sorted, experts, offsets, out=C, validate=False),
        "gather": lambda: ex._launch_grouped(A_rows, experts, offsets, C, row_ids=ident),
        "gather/8": lambda: ex._launch_grouped(x_tok, experts, offsets, C, row_ids=ident,
                                               ids_per_row=top_k),
        "moe_linear": lambda: moe_linear(x, ids, experts, out=out3, validate=False),
        "route only": lambda: ex.route_pairs(ids, E),
    }
    for op in ops.values():
        op()
    cp.cuda.Device().synchronize()
    _time_and_print(T, ops)


if __name__ == "__main__":
    raise SystemExit(main())
