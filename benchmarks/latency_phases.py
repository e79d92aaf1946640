"""Where the latency kernel's time goes: phase stamps inside gemm_latency.cu (device only).

The kernel is built with -DKBIT_LATENCY_PHASES, which makes lane 0 of every
warp write the global timer (ns) and its SM's clock at six points:

    0 entry                          4 the partial tiles in shared memory
    1 the first weight tile arrived  5 exit
    2 the staged rows of A ready     6 the first tile's scales arrived
    3 the warp's K tiles decoded     7 the codebook arrived
      and multiplied
(1, 6 and 7 are stamped after 2, in that order: each is when both that
point and the ones before it were reached. With --define
KBIT_LATENCY_PHASES_LOADS_FIRST=1 they are stamped before the staging's wait
instead, so 1 is when the first tile itself arrived and 2 comes after them.)

The public call (``kbit_gemm(..., kernel="latency")``, launch plan as the
package makes it) runs in a CUDA graph of (256 MB overwrite, call), the
TARGETS.md cold-L2 setting; after each replay the stamps are read back.
Printed per (layer, k, M), as medians over the replays:

- ``start spread``: the last CTA's entry after the first's (how the grid is
  laid onto the SMs);
- per point, the time since the CTA's own entry, of the median CTA and of
  the slowest CTA (over the CTA's warps: the last to get there);
- ``span``: the last exit after the first entry, against the kernel-only
  time of the same call (harness.time_graph) with and without the stamps.

    PYTHONPATH=. python benchmarks/latency_phases.py --layers 2048x768 768x2048 --k 2 4 --m 1 16

With ``--moe E,TOP_K`` the call is instead ``moe_linear`` over E experts of
each layer's shape, T = each ``--m`` tokens routed by a seeded uniform router
(the few-pair launch, a CTA per (pair, row tile): issue 21 at T = 1); with
``--grouped`` as well, ``kbit_grouped_gemm`` on the same pairs grouped by
expert (its few-rows launch: each CTA finds its row's expert in the offsets).
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np

POINTS = ("weights in", "A staged", "decoded", "reduced", "exit", "scales in", "codebook in")


def probed_kernels(k: int, dtype_name: str, scale_name: str) -> dict:
    """Build the gemm_latency variants of (k, dtype, scale) with the stamps (one
    and two n8 tiles, and the twins the host may ask for instead: the codebook
    fold, _jit.cb_fold_variant, and the dense and MoE launches' half K tiles),
    put them in the package's kernel cache, and return {template args: module}."""
    import cupy as cp

    from kbit_cupy import _jit

    wanted = []
    for m_tiles in _jit.GEMM_LATENCY_M_TILES:
        for args in [(k, dtype_name, scale_name, m_tiles)] + (
                [(k, dtype_name, scale_name, m_tiles, False, False, 2)]
                if k in _jit.DENSE_LATENCY_KSPLIT_KS and scale_name == "uint8" else []):
            wanted += [args] + [f for f in [_jit.cb_fold_variant("gemm_latency", args)] if f]
    if (k in _jit.MOE_LATENCY_KSPLIT_KS and scale_name == "uint8"
            and (k, dtype_name, scale_name, 1, False, False, 2) not in wanted):
        wanted.append((k, dtype_name, scale_name, 1, False, False, 2))
    modules = {}
    for args in wanted:
        name = _jit.kernel_name("gemm_latency", *args)
        module = cp.RawModule(
            code=_jit.render_source("gemm_latency"),
            options=_jit.compile_options(),
            name_expressions=[name],
        )
        _jit._kernels[("gemm_latency", args, cp.cuda.runtime.getDevice())] = module.get_function(
            name
        )
        modules[args] = module
    return modules


def latency_args_of(call) -> list:
    """The gemm_latency template arguments ``call()`` asks the kernel cache for
    (its launch plans are made on that call), in order."""
    from kbit_cupy import _jit

    asked = []
    real = _jit.get_kernel
    _jit.get_kernel = lambda family, *args: asked.append((family, args)) or real(family, *args)
    try:
        call()
    finally:
        _jit.get_kernel = real
    return [args for family, args in asked if family == "gemm_latency"]


def stamps_view(module, ctas_cap: int, max_warps: int, points: int,
                symbol: str = "kbit_latency_phases"):
    """The module's stamp array ``symbol`` as a [ctas_cap, max_warps, points, 2] uint64 CuPy view."""
    import cupy as cp

    ptr = module.get_global(symbol)
    n = ctas_cap * max_warps * points * 2
    mem = cp.cuda.UnownedMemory(ptr.ptr, n * 8, module)
    return cp.ndarray((ctas_cap, max_warps, points, 2), cp.uint64, cp.cuda.MemoryPointer(mem, 0))


def summarize(samples: list[np.ndarray]) -> dict:
    """Medians over replays of the per-replay figures. Times within a CTA come
    from its SM's clock (the global timer ticks in 256 ns steps on the H100),
    converted at the clock rate measured over all replays (clock cycles over
    global-timer ns between entry and exit, summed); the start spread and the
    span, across SMs, from the global timer."""
    used_all = [st[:, :, 0, 0] > 0 for st in samples]
    dc = sum(
        float((st[..., 5, 1].astype(np.float64) - st[..., 0, 1])[u & (st[..., 5, 1] > 0)].sum())
        for st, u in zip(samples, used_all)
    )
    dt = sum(
        float((st[..., 5, 0].astype(np.float64) - st[..., 0, 0])[u & (st[..., 5, 0] > 0)].sum())
        for st, u in zip(samples, used_all)
    )
    ghz = dc / dt if dt > 0 else float("nan")
    rows = []
    for st, used in zip(samples, used_all):  # [ctas, warps, points, 2], zero: no stamp
        t = st[..., 0].astype(np.float64)
        c = st[..., 1].astype(np.float64)
        entry_t = np.where(used, t[:, :, 0], np.inf).min(axis=1)  # per CTA
        entry_c = np.where(used, c[:, :, 0], np.inf).min(axis=1)
        rec = {"spread": entry_t.max() - entry_t.min()}
        for p in range(1, st.shape[2]):
            cp_ = np.where(used & (c[:, :, p] > 0), c[:, :, p], -np.inf).max(axis=1) - entry_c
            cp_ = cp_[np.isfinite(cp_)] / ghz
            rec[f"p{p}_med"] = float(np.median(cp_)) if cp_.size else float("nan")
            rec[f"p{p}_max"] = float(cp_.max()) if cp_.size else float("nan")
        rec["span"] = float(np.where(used, t[:, :, 5], -np.inf).max() - entry_t.min())
        rows.append(rec)
    out = {key: float(np.median([r[key] for r in rows])) for key in rows[0]}
    out["ghz"] = ghz
    return out


def phases(module, call, stream, replays: int, flush_kind: str = "overwrite",
           symbol: str = "kbit_latency_phases", max_warps: int = 0, points: int = 8
           ) -> tuple[dict, int, int]:
    """Stamps of ``replays`` graph replays of (256 MB overwrite, or read with
    ``flush_kind`` "read", then ``call()``, the stamped launch): (summarize's
    medians, CTAs, warps per CTA). ``symbol``, ``max_warps``: the module's
    stamp array, its warps per CTA (default: gemm_latency.cu's) and points."""
    import cupy as cp

    from kbit_cupy import _jit
    from kbit_cupy.bench import harness

    view = stamps_view(module, 2048, max_warps or _jit.GEMM_LATENCY_MAX_WARPS, points, symbol)
    samples = []
    with stream:
        flush = (harness.read_flusher(harness.DEFAULT_FLUSH_BYTES) if flush_kind == "read"
                 else harness._flusher(harness.DEFAULT_FLUSH_BYTES))

        def body():
            flush()
            call()

        graph = harness._capture(stream, body)
        for r in range(replays + 2):  # two warm-up replays
            view.fill(0)
            graph.launch(stream=stream)
            stream.synchronize()
            if r >= 2:
                samples.append(cp.asnumpy(view))
        del graph
    ctas = int(np.flatnonzero((samples[0][:, :, 0, 0] > 0).any(axis=1)).max()) + 1
    samples = [st[:ctas] for st in samples]
    warps = int((samples[0][:, :, 0, 0] > 0).sum(axis=1).max())
    return summarize(samples), ctas, warps


def add_flush_argument(p: argparse.ArgumentParser) -> None:
    """--flush: what comes before each stamped call (``phases``' flush_kind)."""
    p.add_argument("--flush", default="overwrite", choices=["overwrite", "read"],
                   help="before each stamped call: the TARGETS.md 256 MB overwrite (L2 left "
                        "dirty) or a 256 MB read (L2 left clean); the graph columns keep the "
                        "overwrite")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=["2048x768", "768x2048", "2048x512", "4096x4096"])
    p.add_argument("--k", nargs="+", type=int, default=[2, 4])
    p.add_argument("--m", nargs="+", type=int, default=[1, 16])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--replays", type=int, default=15)
    add_flush_argument(p)
    p.add_argument("--grouped", action="store_true",
                   help="with --moe: kbit_grouped_gemm on the same pairs grouped by expert "
                        "instead of moe_linear")
    p.add_argument("--moe", default=None, metavar="E,TOP_K",
                   help="time moe_linear over E experts, top-k routing, T = --m tokens")
    p.add_argument(
        "--define",
        action="append",
        default=[],
        help="NAME=VALUE: also compile the stamped kernels with -DNAME=VALUE; "
        "module.ATTR=VALUE: set that int attribute of a kbit_cupy module for the whole run",
    )
    args = p.parse_args()

    import cupy as cp
    from define_ab import kernels_built_with, module_attributes

    from kbit_cupy import (
        gemm,
        kbit_gemm,
        kbit_grouped_gemm,
        moe_linear,
        quantize_experts,
        quantize_weight,
    )
    from kbit_cupy._arrays import BFLOAT16
    from kbit_cupy.bench import harness

    cdefs = [d for d in args.define if "." not in d.split("=")[0]]
    attrs = dict(d.split("=") for d in args.define if d not in cdefs)
    dtype = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}[args.dtype]
    info = harness.gpu_info()
    print(
        f"{info['gpu']}  commit {os.environ.get('KBIT_COMMIT', info.get('commit'))}  "
        f"{args.dtype}, cold L2 (stamps after a 256 MB {args.flush}), graph replays {args.replays}, defines {args.define}",
        flush=True,
    )
    print("times in us since each CTA's entry: median CTA / slowest CTA")
    head = (
        f"{'layer':>10} {'k':>2} {'M':>3} {'CTAs':>5} {'warps':>5} {'spread':>6} "
        + " ".join(f"{n:>13}" for n in POINTS)
        + f" {'span':>6} {'graph':>6} {'plain':>6} {'GHz':>5}"
    )
    print(head, flush=True)
    with module_attributes(attrs):  # for the whole run
        for layer in args.layers:
            K_dim, N = (int(v) for v in layer.lower().split("x"))
            E, top_k = (int(v) for v in args.moe.split(",")) if args.moe else (0, 0)
            W = (
                cp.random.default_rng(0).standard_normal(((E,) if E else ()) + (N, K_dim),
                                                         dtype=cp.float32)
                * np.float32(0.02)
            ).astype(cp.float16)
            quantize = quantize_experts if E else quantize_weight
            for k in args.k:
                plain_w = quantize(W, k=k).prepare()
                probe_w = quantize(W, k=k).prepare()
                cp.cuda.Device().synchronize()  # prepare() ran on the default stream
                stream = harness._bench_stream()
                As, outs_q, ids = {}, {}, {}

                grouped = {}  # M -> (rows of A grouped by expert, group offsets)

                def call(M, w, out, E=E, As=As, ids=ids, grouped=grouped):
                    """The call of M rows (tokens) on weight w into out."""
                    if E and args.grouped:
                        rows, offsets = grouped[M]
                        return functools.partial(kbit_grouped_gemm, rows, w, offsets, out=out,
                                                 validate=False)
                    if E:
                        return functools.partial(moe_linear, As[M], ids[M], w, out=out,
                                                 validate=False)
                    return functools.partial(kbit_gemm, As[M], w, out=out, kernel="latency")

                def out_like(M, E=E, top_k=top_k, N=N):
                    if E and args.grouped:
                        return cp.empty((M * top_k, N), dtype)
                    return cp.empty((M, top_k, N) if E else (M, N), dtype)

                with stream:  # plans are per stream: make them on the harness's, plain ones first
                    for M in [m for m in args.m if E or m <= gemm._latency_rows(K_dim, 2)]:
                        As[M] = (
                            cp.random.default_rng(1)
                            .standard_normal((M, K_dim), dtype=cp.float32)
                            .astype(dtype)
                        )
                        rng = np.random.default_rng(2)
                        ids[M] = cp.asarray(np.stack([rng.choice(E, top_k, replace=False)
                                                      for _ in range(M)]).astype(np.int32)
                                            if E else np.zeros(1, np.int32))
                        if E:  # the same pairs as rows grouped by expert (a stable sort)
                            flat = cp.asnumpy(ids[M]).reshape(-1)
                            order = np.argsort(flat, kind="stable")
                            offs = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
                            grouped[M] = (As[M][cp.asarray(order // top_k)],
                                          cp.asarray(offs.astype(np.int32)))
                        outs_q[M] = out_like(M)
                        call(M, plain_w, outs_q[M])()
                with kernels_built_with(("-DKBIT_LATENCY_PHASES", *(f"-D{d}" for d in cdefs))):
                    modules = probed_kernels(k, dtype.name, probe_w.absmax.dtype.name)
                    for M in As:
                        out_q, out_p = outs_q[M], out_like(M)
                        with stream:
                            used = latency_args_of(call(M, probe_w, out_p))
                            stream.synchronize()
                        if not bool(cp.all(out_p == out_q)):
                            print(
                                f"  {layer} k={k} M={M}: stamped and plain kernels' bits differ"
                                + (
                                    " (expected where a define changes the sums)"
                                    if args.define
                                    else ""
                                )
                            )
                        # the launched variant is the last asked (gemm._plan_latency_launch
                        # asks for the whole-tile one first where its geometry picks half K tiles)
                        if not used or len(used) > 2 or used[-1] not in modules:
                            raise SystemExit(f"{layer} k={k} M={M}: the call asked for gemm_latency "
                                             f"{used}, not a stamped variant last ({list(modules)})")
                        module = modules[used[-1]]
                        s, ctas, warps = phases(module, call(M, probe_w, out_p), stream,
                                                args.replays, args.flush)
                        t_probe = harness.time_graph(call(M, probe_w, out_p), reps=20)
                        t_plain = harness.time_graph(call(M, plain_w, out_q), reps=20)
                        cells = " ".join(
                            f"{s[f'p{i}_med'] / 1e3:6.2f}/{s[f'p{i}_max'] / 1e3:6.2f}"
                            for i in range(1, 8)
                        )
                        print(
                            f"{layer:>10} {k:>2} {M:>3} {ctas:>5} {warps:>5} {s['spread'] / 1e3:6.2f} "
                            f"{cells} {s['span'] / 1e3:6.2f} {t_probe['median_us']:6.2f} "
                            f"{t_plain['median_us']:6.2f} {s['ghz']:5.2f}",
                            flush=True,
                        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
