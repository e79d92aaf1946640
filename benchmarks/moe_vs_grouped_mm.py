"""k-bit MoE products against torch's one-launch grouped GEMM over bf16 experts (issue 21).

    python benchmarks/moe_vs_grouped_mm.py                       # all configs, T = 1 8 32 128 512
    python benchmarks/moe_vs_grouped_mm.py --out benchmarks/results/moe_vs_grouped_mm_h100
    python benchmarks/moe_vs_grouped_mm.py --configs e128_top8_2048x1536 --t 1 32

In one process on one GPU, per (config, T): a seeded uniform router picks
each token's top-k distinct experts (``kbit_cupy.bench.moe.route``, the
routing of ``bench-moe``); the (token, choice) rows are grouped by expert
(stable sort) outside the timing, and these ops are timed:

- ``torch_bf16``: ``torch._grouped_mm(rows, W, offs=ends)``, one launch over
  all experts' bf16 weights ``W`` ``[E, K_dim, N]`` (the ``[E, N, K_dim]``
  tensor's transposed view), ``ends`` int32 cumulative row ends per expert
  (E entries). The bf16 experts are our dequantized k=4 weights, so both
  sides compute the same products. Without ``_grouped_mm`` (or where it
  fails) the baseline is the faster of one ``torch.bmm`` over the active
  experts padded to the largest group (cuBLAS strided-batched) and one
  ``torch.mm`` per active expert (``--cublas`` times them anyway);
- ``grouped_fp16`` / ``grouped_bf16``: ``kbit_grouped_gemm(..., validate=False)``
  on the same grouped rows (fp16 or bf16 activations);
- ``moe_fp16`` / ``moe_bf16``: ``moe_linear(x, ids, ..., validate=False)``,
  routing included, results in token order.

Two figures each (TARGETS.md "How a number is taken"): kernel-only, a CUDA
graph of (256 MB overwrite, op) pairs minus a graph of overwrites
(``harness.time_graph``; torch runs on CuPy's capturing stream through
``torch.cuda.ExternalStream``, and if that capture fails, a torch-captured
graph of the same pairs is used instead), and eager (``harness.time_ops``:
overwrite, event, op, event; ops interleaved rep by rep). Torch and CuPy
share memory through DLPack (bf16 as int16 bits) and run on the same stream,
timed by the same events. ``floor_us`` is the touched experts' k=4 bytes
(indices + scales) over the device-to-device copy bandwidth measured in this
run. Ratios are ``torch_bf16 / ours`` (> 1: ours is faster); ``moe/grouped``
is ``moe_bf16 / grouped_bf16`` (issue target <= 1.15).

Correctness (at ``--check-t`` tokens, every config): torch's result and ours
(grouped and moe_linear, fp16 and bf16) against a float64 product of the
same activations and the float32 dequantized weights, relative Frobenius
error within FORMAT.md section 7 (2e-3 fp16, 1e-2 bf16). Failures are
reported, not fatal (errors too): what was measured is written, and the exit
status is 3. Torch is used only here, never by the package.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# name -> (experts, top_k, N, K_dim, where the shape comes from)
CONFIGS = {
    "e128_top8_2048x1536": (128, 8, 1536, 2048, (
        "issue 21; Qwen3-30B-A3B experts' gate_up (hidden 2048 -> 2 x moe_intermediate 768), "
        "128 experts, top-8")),
    "e128_top8_768x2048": (128, 8, 2048, 768, (
        "issue 21; Qwen3-30B-A3B experts' down (moe_intermediate 768 -> hidden 2048)")),
    "e512_top10_2048x512": (512, 10, 512, 2048, (
        "issue 21; Qwen3-Next-80B-A3B-shaped (512 experts, top-10, hidden 2048, "
        "moe_intermediate 512): gate or up alone")),
    "qwen3_235b_gate_up": (128, 8, 3072, 4096, (
        "Qwen3-235B-A22B experts' gate_up (hidden 4096 -> 2 x moe_intermediate 1536), "
        "128 experts, top-8")),
    "mixtral_8x7b_w13": (8, 2, 28672, 4096, (
        "Mixtral-8x7B experts' w1+w3 (hidden 4096 -> 2 x 14336), 8 experts, top-2")),
}
DEFAULT_T = [1, 8, 32, 128, 512]
K_BITS = 4
TOL = {"fp16": 2e-3, "bf16": 1e-2}  # FORMAT.md section 7, relative Frobenius error
OURS = ("grouped_fp16", "grouped_bf16", "moe_fp16", "moe_bf16")
COLUMNS = ["config", "T", "mode", "active", "floor_us", "torch_bf16_us", "grouped_fp16_us",
           "grouped_bf16_us", "moe_fp16_us", "moe_bf16_us", "x_grouped_bf16", "x_grouped_fp16",
           "x_moe_bf16", "x_moe_fp16", "moe/grouped"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="k=4 kbit_grouped_gemm / moe_linear vs torch._grouped_mm (bf16 experts), "
                    "kernel-only (CUDA graphs) and eager, cold L2, one GPU (needs torch).")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   metavar="NAME", help="configs to run (default all): " + ", ".join(CONFIGS))
    p.add_argument("--t", nargs="+", type=int, default=DEFAULT_T, metavar="T",
                   help="token counts (default 1 8 32 128 512)")
    p.add_argument("--reps", type=int, default=30, help="eager reps per op (default 30)")
    p.add_argument("--graph-reps", type=int, default=20,
                   help="(overwrite, op) pairs per graph (default 20)")
    p.add_argument("--replays", type=int, default=7, help="graph replays timed (default 7)")
    p.add_argument("--check-t", type=int, default=32,
                   help="tokens of the correctness check per config (default 32; 0 skips it)")
    p.add_argument("--cublas", action="store_true",
                   help="also time the cuBLAS fallbacks (padded bmm, per-expert mm)")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.json and PREFIX.md")
    args = p.parse_args(argv)
    if min(args.t) < 1 or args.reps < 1 or args.graph_reps < 1 or args.replays < 1:
        p.error("token counts, reps, graph reps and replays must be >= 1")
    return args


# --------------------------------------------------------------------------
# torch <-> CuPy


class Bridge:
    """Torch on CuPy's current stream, and bf16 arrays shared as int16 bits."""

    def __init__(self, torch, cp):
        from kbit_cupy._arrays import BFLOAT16

        self.torch, self.cp, self.bf16 = torch, cp, BFLOAT16
        self._streams = {}

    def stream(self):
        """The torch stream wrapping CuPy's current stream (cached per pointer)."""
        ptr = self.cp.cuda.get_current_stream().ptr
        s = self._streams.get(ptr)
        if s is None:
            t = self.torch.cuda
            s = self._streams[ptr] = t.ExternalStream(ptr) if ptr else t.default_stream()
        return s

    def on_cupy_stream(self, fn):
        """``fn`` wrapped to launch on CuPy's current stream (what the harness times)."""
        torch = self.torch

        def op():
            with torch.cuda.stream(self.stream()):
                return fn()

        return op

    def to_cupy_bf16(self, t):
        """A contiguous torch bf16 tensor as a CuPy bf16 array (same memory)."""
        return self.cp.from_dlpack(t.contiguous().view(self.torch.int16)).view(self.bf16)

    def f32(self, a):
        """A CuPy fp16/bf16/f32 array, or a torch tensor, as CuPy float32 (bf16 widened bitwise)."""
        cp = self.cp
        if isinstance(a, self.torch.Tensor):
            return cp.from_dlpack(a.float().contiguous())
        if a.dtype == self.bf16:
            return (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        return a.astype(cp.float32)


def grouped_mm_fn(torch):
    """torch's one-launch grouped GEMM, or None where this torch lacks it."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        fn = getattr(getattr(torch.nn, "functional", None), "grouped_mm", None)
    return fn


# --------------------------------------------------------------------------
# timing


def torch_graph_time(torch, raw_op, reps: int, replays: int, flush_bytes: int):
    """TARGETS.md graph figure with torch's own capture (fallback where CuPy's fails):
    graph of (overwrite, op) pairs minus graph of overwrites, / reps; median in us."""
    try:
        s = torch.cuda.Stream()
        buf = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
        count = [0]

        def flush():
            count[0] += 1
            buf.fill_(1 + count[0] % 251)

        keep = []
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            flush()
            keep.append(raw_op())
        torch.cuda.synchronize()
        g_pairs, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_pairs, stream=s, capture_error_mode="relaxed"):
            for _ in range(reps):
                flush()
                keep.append(raw_op())
        with torch.cuda.graph(g_flush, stream=s, capture_error_mode="relaxed"):
            for _ in range(reps):
                flush()
        with torch.cuda.stream(s):
            for _ in range(2):
                g_pairs.replay()
                g_flush.replay()
            evs = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
                   for _ in range(replays)]
            for e0, e1, e2 in evs:
                e0.record(s)
                g_pairs.replay()
                e1.record(s)
                g_flush.replay()
                e2.record(s)
        torch.cuda.synchronize()
        per_op = [1e3 * (e0.elapsed_time(e1) - e1.elapsed_time(e2)) / reps for e0, e1, e2 in evs]
        del g_pairs, g_flush, keep
        return float(np.median(per_op))
    except Exception as e:  # noqa: BLE001 - report and go on without the figure
        print(f"torch graph capture failed too ({type(e).__name__}: {e})", file=sys.stderr)
        return None


# --------------------------------------------------------------------------
# one config


class Config:
    """Quantized experts (ours) and their dequantized bf16 copy (torch's)."""

    def __init__(self, name, br: Bridge):
        import cupy as cp

        from kbit_cupy import quantize_experts

        torch = br.torch
        self.name = name
        self.E, self.top_k, self.N, self.K, self.source = CONFIGS[name]
        E, N, K = self.E, self.N, self.K
        rng = cp.random.default_rng(0)
        W = rng.standard_normal((E, N, K), dtype=cp.float32)
        W *= np.float32(0.02)
        W16 = W.astype(cp.float16)
        del W
        self.experts = quantize_experts(W16, K_BITS).prepare()
        del W16
        cp.get_default_memory_pool().free_all_blocks()
        # torch's experts: our k=4 weights dequantized (float32), rounded to bf16, [E, N, K]
        self.w_nk = torch.empty((E, N, K), dtype=torch.bfloat16, device="cuda")
        for e in range(E):
            self.w_nk[e].copy_(torch.from_dlpack(self.experts.expert(e).dequantize(np.float32)))
        cp.cuda.Device().synchronize()
        torch.cuda.synchronize()
        self.w_kn = self.w_nk.transpose(1, 2)  # [E, K, N], stride(-2) == 1 ("transposed")


class Case:
    """Routed tokens of one (config, T) and the ops on them."""

    def __init__(self, cfg: Config, T: int, br: Bridge, gmm, w_for_gmm):
        import cupy as cp

        from kbit_cupy import kbit_grouped_gemm, moe_linear
        from kbit_cupy.bench.moe import route

        torch = br.torch
        E, top_k, N, K = cfg.E, cfg.top_k, cfg.N, cfg.K
        ids = route(T, E, top_k, seed=T)  # [T, top_k] int32, distinct per token
        flat = ids.reshape(-1)
        self.order = np.argsort(flat, kind="stable")  # grouped row -> (token, choice) pair
        counts = np.bincount(flat, minlength=E)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)  # ours: E + 1
        self.counts, self.offsets = counts, offsets
        self.active = np.flatnonzero(counts)
        R = int(flat.size)
        self.T, self.R = T, R
        tok = self.order // top_k

        x32 = cp.asarray(np.random.default_rng(1000 + T).standard_normal((T, K), np.float32))
        self.x16 = x32.astype(cp.float16)
        self.rows16 = cp.ascontiguousarray(self.x16[cp.asarray(tok)])
        x_bf_t = torch.from_dlpack(x32).to(torch.bfloat16).contiguous()
        self.rows_bf_t = x_bf_t[torch.as_tensor(tok, dtype=torch.int64, device="cuda")].contiguous()
        self.x_bf = br.to_cupy_bf16(x_bf_t)
        self.rows_bf = br.to_cupy_bf16(self.rows_bf_t)
        self._keep = (x_bf_t,)
        d_ids, d_off = cp.asarray(ids), cp.asarray(offsets)
        ends_t = torch.from_dlpack(cp.asarray(offsets[1:])).to(torch.int32).contiguous()
        self.ends_t = ends_t

        self.out = {
            "grouped_fp16": cp.empty((R, N), cp.float16),
            "grouped_bf16": cp.empty((R, N), br.bf16),
            "moe_fp16": cp.empty((T, top_k, N), cp.float16),
            "moe_bf16": cp.empty((T, top_k, N), br.bf16),
        }
        ex, o = cfg.experts, self.out
        self.ours = {
            "grouped_fp16": lambda: kbit_grouped_gemm(self.rows16, ex, d_off,
                                                      out=o["grouped_fp16"], validate=False),
            "grouped_bf16": lambda: kbit_grouped_gemm(self.rows_bf, ex, d_off,
                                                      out=o["grouped_bf16"], validate=False),
            "moe_fp16": lambda: moe_linear(self.x16, d_ids, ex, out=o["moe_fp16"],
                                           validate=False),
            "moe_bf16": lambda: moe_linear(self.x_bf, d_ids, ex, out=o["moe_bf16"],
                                           validate=False),
        }
        # torch ops, raw (they launch on torch's current stream)
        self.torch_raw = {}
        if gmm is not None and w_for_gmm is not None:
            rows_t = self.rows_bf_t
            self.torch_raw["torch_grouped"] = lambda: gmm(rows_t, w_for_gmm, offs=ends_t)

    def add_cublas(self, cfg: Config, torch):
        """The cuBLAS fallbacks: padded strided-batched bmm over the active experts, and
        one mm per active expert (weights gathered / padded outside the timing)."""
        act = self.active
        pad = int(self.counts.max())
        dev = "cuda"
        idx = torch.as_tensor(act, dtype=torch.int64, device=dev)
        w_act = cfg.w_nk.index_select(0, idx).transpose(1, 2)  # [A, K, N] view
        a_pad = torch.zeros((act.size, pad, cfg.K), dtype=torch.bfloat16, device=dev)
        for i, e in enumerate(act):
            r0, r1 = int(self.offsets[e]), int(self.offsets[e + 1])
            a_pad[i, : r1 - r0] = self.rows_bf_t[r0:r1]
        c_pad = torch.empty((act.size, pad, cfg.N), dtype=torch.bfloat16, device=dev)
        c_loop = torch.empty((self.R, cfg.N), dtype=torch.bfloat16, device=dev)
        spans = [(int(self.offsets[e]), int(self.offsets[e + 1]), cfg.w_kn[int(e)]) for e in act]
        rows_t = self.rows_bf_t
        # padded row (i, r) -> its place in the flat [A * pad, N] result, in grouped order
        self.unpad_t = torch.as_tensor(
            np.concatenate([i * pad + np.arange(self.counts[e]) for i, e in enumerate(act)]),
            dtype=torch.int64, device=dev)

        def loop():
            for r0, r1, w in spans:
                torch.mm(rows_t[r0:r1], w, out=c_loop[r0:r1])
            return c_loop

        self.torch_raw["torch_bmm_padded"] = lambda: torch.bmm(a_pad, w_act, out=c_pad)
        self.torch_raw["torch_mm_loop"] = loop


# --------------------------------------------------------------------------
# correctness


def check_case(case: Case, cfg: Config, br: Bridge) -> list[dict]:
    """Ours and torch's against float64 products of the same activations and weights."""
    cp = br.cp
    top_k, N = cfg.top_k, cfg.N
    rows = {"fp16": br.f32(case.rows16).astype(cp.float64),
            "bf16": br.f32(case.rows_bf).astype(cp.float64)}
    ref = {d: cp.zeros((case.R, N), cp.float64) for d in rows}
    for e in case.active:
        r0, r1 = int(case.offsets[e]), int(case.offsets[e + 1])
        w = cfg.experts.expert(int(e)).dequantize(np.float32).astype(cp.float64)
        for d in rows:
            ref[d][r0:r1] = rows[d][r0:r1] @ w.T
    got = {}
    for name, op in case.ours.items():
        out = br.f32(op())
        if name.startswith("moe"):  # token order -> grouped order
            out = out.reshape(case.T * top_k, N)[cp.asarray(case.order)]
        got[name] = out
    cp.cuda.Device().synchronize()
    for name, raw in case.torch_raw.items():
        res = raw()
        if name == "torch_bmm_padded":
            res = res.reshape(-1, N)[case.unpad_t]
        got[name] = br.f32(res)
        br.torch.cuda.synchronize()

    def rel(a, b):
        return float(cp.linalg.norm(a.astype(cp.float64) - b) / cp.linalg.norm(b))

    out = []
    for name, val in got.items():
        d = "fp16" if name.endswith("fp16") else "bf16"
        err = rel(val, ref[d])
        out.append({"config": cfg.name, "T": case.T, "op": name, "dtype": d, "rel_err": err,
                    "tol": TOL[d], "ok": bool(err <= TOL[d])})
    if "torch_grouped" in got:
        err = rel(got["grouped_bf16"], got["torch_grouped"].astype(cp.float64))
        out.append({"config": cfg.name, "T": case.T, "op": "grouped_bf16 vs torch_grouped",
                    "dtype": "bf16", "rel_err": err, "tol": 2 * TOL["bf16"],
                    "ok": bool(err <= 2 * TOL["bf16"])})
    for c in out:
        print(f"check {c['config']} T={c['T']} {c['op']:<30} rel err {c['rel_err']:.2e} "
              f"(tol {c['tol']:.0e}) {'ok' if c['ok'] else 'FAILED'}", flush=True)
    return out


# --------------------------------------------------------------------------
# the run


def probe_grouped_mm(torch, gmm, cfg: Config):
    """The weight layout torch's grouped GEMM accepts here ([E,K,N] transposed view first,
    then contiguous), or None with the reason printed."""
    if gmm is None:
        print(f"torch {torch.__version__} has no torch._grouped_mm: baseline falls back to "
              "cuBLAS (padded bmm, per-expert mm)", flush=True)
        return None
    a = torch.randn((cfg.top_k, cfg.K), device="cuda").to(torch.bfloat16)
    ends = torch.full((cfg.E,), cfg.top_k, dtype=torch.int32, device="cuda")
    for label, w in (("[E,K,N] transposed view", cfg.w_kn), ("[E,K,N] contiguous", None)):
        try:
            if w is None:
                w = cfg.w_kn.contiguous()
            gmm(a, w, offs=ends)
            torch.cuda.synchronize()
            print(f"torch._grouped_mm takes weights as {label}", flush=True)
            return w
        except Exception as e:  # noqa: BLE001
            print(f"torch._grouped_mm rejects {label}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
    print("torch._grouped_mm unusable here: baseline falls back to cuBLAS", flush=True)
    return None


def time_case(case: Case, br: Bridge, args, copy_bw: float, cfg: Config) -> list[dict]:
    from kbit_cupy.bench import harness

    torch = br.torch
    torch_ops = {n: br.on_cupy_stream(f) for n, f in case.torch_raw.items()}
    eager = harness.time_ops({**torch_ops, **case.ours}, reps=args.reps, warmup=3)
    graph = {}
    for name, op in {**torch_ops, **case.ours}.items():
        r = harness.time_graph(op, reps=args.graph_reps, warmup=2, replays=args.replays)
        if r is not None:
            graph[name] = r["median_us"]
        elif name in case.torch_raw:
            print(f"{name}: CuPy's capture failed; capturing with torch.cuda.graph", flush=True)
            graph[name] = torch_graph_time(torch, case.torch_raw[name], args.graph_reps,
                                           args.replays, harness.DEFAULT_FLUSH_BYTES)
        else:
            graph[name] = None
    for name in torch_ops:
        g, e = graph.get(name), eager[name]["median_us"]
        if g is not None and g < 0.3 * e:
            print(f"WARNING {cfg.name} T={case.T} {name}: graph {g:.1f} us << eager {e:.1f} us; "
                  "was it captured?", flush=True)
    floor_us = case.active.size * cfg.experts.expert_nbytes / copy_bw * 1e6
    recs = []
    for mode, t in (("graph", graph), ("eager", {n: r["median_us"] for n, r in eager.items()})):
        base_names = [n for n in t if n.startswith("torch") and t[n] is not None]
        base = (t["torch_grouped"] if t.get("torch_grouped") is not None
                else min((t[n] for n in base_names), default=None))
        rec = {"config": cfg.name, "E": cfg.E, "top_k": cfg.top_k, "N": cfg.N, "K_dim": cfg.K,
               "T": case.T, "mode": mode, "rows": case.R, "active": int(case.active.size),
               "max_rows": int(case.counts.max()), "floor_us": floor_us,
               "touched_bytes": int(case.active.size * cfg.experts.expert_nbytes),
               "torch_bf16_us": base,
               "baseline": "torch_grouped" if t.get("torch_grouped") is not None else
               "min(" + ", ".join(base_names) + ")"}
        for n in t:
            if n.startswith("torch"):
                rec[f"{n}_us"] = t[n]
        for n in OURS:
            rec[f"{n}_us"] = t.get(n)
            rec[f"x_{n}"] = base / t[n] if base and t.get(n) else None
        rec["moe/grouped"] = (t["moe_bf16"] / t["grouped_bf16"]
                              if t.get("moe_bf16") and t.get("grouped_bf16") else None)
        recs.append(rec)
    return recs


def run_config(name, br: Bridge, gmm, args, copy_bw, records, checks, layouts, errors):
    """All token counts of one config (appends to records, checks, layouts, errors)."""
    torch = br.torch
    cfg = Config(name, br)
    w_for_gmm = probe_grouped_mm(torch, gmm, cfg)
    layouts[name] = None if w_for_gmm is None else (
        "transposed view" if w_for_gmm is cfg.w_kn else "contiguous [E,K,N]")
    ts = list(args.t)
    if args.check_t and args.check_t not in ts:
        ts.append(args.check_t)
    for T in ts:
        try:
            case = Case(cfg, T, br, gmm, w_for_gmm)
            if args.cublas or w_for_gmm is None:
                case.add_cublas(cfg, torch)
            if T == args.check_t:
                checks += check_case(case, cfg, br)
            if T in args.t:
                recs = time_case(case, br, args, copy_bw, cfg)
                records += recs
                for r in recs:
                    print(f"{name} T={T:<4} {r['mode']:<5} torch {fmt(r['torch_bf16_us'])} us | "
                          f"grouped fp16 {fmt(r['grouped_fp16_us'])} bf16 "
                          f"{fmt(r['grouped_bf16_us'])} | moe fp16 {fmt(r['moe_fp16_us'])} "
                          f"bf16 {fmt(r['moe_bf16_us'])} | x {fmt(r['x_grouped_bf16'])} / "
                          f"{fmt(r['x_moe_bf16'])} | floor {fmt(r['floor_us'])} us", flush=True)
        except Exception as e:  # noqa: BLE001 - keep going: one run on the device
            errors.append(f"{name} T={T}: {type(e).__name__}: {e}")
            print(f"ERROR {errors[-1]}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            br.cp.cuda.Device().synchronize()


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def print_table(records):
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join("---" if c in ("config", "mode") else "---:" for c in COLUMNS) + "|")
    for r in records:
        print("| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("moe_vs_grouped_mm.py needs torch (with CUDA); it is not installed here.",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("moe_vs_grouped_mm.py needs a CUDA GPU visible to torch; none found.",
              file=sys.stderr)
        return 1
    import cupy as cp

    from kbit_cupy.bench import harness

    t_start = time.time()
    br = Bridge(torch, cp)
    gmm = grouped_mm_fn(torch)
    info = harness.gpu_info()
    copy_bw = harness.copy_bandwidth(1 << 30)
    print(f"{info['gpu']} {info['cc']}  commit {info['commit']}  torch {torch.__version__}  "
          f"copy {copy_bw / 1e12:.3f} TB/s", flush=True)
    records, checks, layouts = [], [], {}
    errors = []
    for name in args.configs:
        try:
            run_config(name, br, gmm, args, copy_bw, records, checks, layouts, errors)
        except Exception as e:  # noqa: BLE001 - one run on the device: keep what was measured
            errors.append(f"{name}: {type(e).__name__}: {e}")
            print(f"ERROR {errors[-1]}", file=sys.stderr, flush=True)
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    records.sort(key=lambda r: (r["mode"] != "graph", args.configs.index(r["config"]), r["T"]))
    print()
    print_table(records)
    bad = [c for c in checks if not c["ok"]]
    if errors:
        print(f"\n{len(errors)} errors: " + "; ".join(errors))
    print(f"\ncorrectness: {len(checks) - len(bad)}/{len(checks)} within tolerance"
          + ("" if not bad else "; FAILED: " + ", ".join(f"{c['config']} {c['op']}"
                                                          for c in bad)))
    print(f"total {time.time() - t_start:.0f} s")
    if args.out:
        meta = {**info, "torch_version": torch.__version__, "k": K_BITS,
                "copy_bandwidth_TB_s": copy_bw / 1e12, "method": harness.METHOD,
                "reps": args.reps, "graph_reps": args.graph_reps, "replays": args.replays,
                "baseline": "torch._grouped_mm over bf16 experts (our k=4 weights dequantized), "
                            "rows grouped by expert, offs = int32 cumulative ends; x_* = "
                            "torch_bf16_us / ours; floor = touched experts' k=4 bytes / copy "
                            "bandwidth; moe/grouped = moe_bf16 / grouped_bf16",
                "grouped_mm_weight_layout": layouts, "checks": checks,
                "checks_ok": not bad, "errors": errors, "configs": {n: CONFIGS[n] for n in args.configs}}
        for n in args.configs:
            meta[f"config {n}"] = CONFIGS[n][4]
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=COLUMNS,
                              title="k=4 MoE products vs torch._grouped_mm (bf16), one GPU")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 3 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
