"""kbit_gemm against the peers a user would pick instead, one GPU, one process (issues 20, 25).

    python benchmarks/peers.py                                   # default layers and M
    python benchmarks/peers.py --layers 8192x57344 --m 1 16 --out benchmarks/results/peers_h200

Per layer (K_dim x N, TARGETS.md's notation) one random fp16 weight W [N, K_dim]
(normal, std 0.02) is quantized by each library its own way, and per M these ops
are timed on one random fp16 A [M, K_dim]:

- ``cublas_fp16``: ``torch.mm(A, W.T)`` (the baseline of every ratio);
- ``tinygemm_int4``: ``torch._weight_int4pack_mm`` (bf16 A, int4 groups of 128,
  bf16 scale and zero per group: 4.25 bits per weight), asymmetric round to
  nearest;
- ``gemlite_w4`` / ``gemlite_w2``: gemlite's Triton A16Wn (fp16 A, int4 / int2
  groups of 128, fp16 scale and zero: 4.25 / 2.25 bits), gemlite's own choice of
  kernel per M and its bundled configuration for the GPU; where gemlite has none
  for this GPU (it matches on the name; it has one for the H100, none for the
  H200) ``--gemlite-config`` picks: ``h100`` (default) loads the H100's,
  ``autotune`` lets gemlite tune on first use (minutes per layer);
- ``bnb_nf4``: bitsandbytes ``matmul_4bit`` (fp16 A, NF4, blocks of 64, fp32
  absmax: 4.5 bits);
- ``kbit_k2`` .. ``kbit_k5``: ``kbit_gemm(A, w, out=..., kernel="auto")``
  (k + 0.25 bits: blocks of 32, one E4M4 scale byte each).

Peers come from wheels carried to the device (the device README); none is
imported by the package. A peer that fails to import, to quantize or to run is
reported and left out; the rest goes on.

Two figures per op (TARGETS.md "How a number is taken"): kernel-only, a CUDA
graph of (256 MB overwrite, op) pairs minus a graph of overwrites
(``harness.time_graph``; torch runs on CuPy's capturing stream, and if that
capture fails, a graph captured by torch is used), and eager
(``harness.time_ops``: overwrite, event, op, event; ops interleaved rep by rep).
A ratio is ``cublas_fp16 time / op time``. ``lead_kN`` says whether kbit at k
bits is faster than every peer that spends as many bits per weight or more
(TARGETS.md: "faster than any peer at the same or more bits per weight").

Sanity check (first M of each layer): every op's result against the float32
product ``A @ W.T``; relative Frobenius error printed and recorded. It is the
quantization error (about 0.1 at 4 bits, 0.3-0.5 at 2 bits); a peer whose
error is above 0.8 is timing garbage and is flagged (exit status 3).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_LAYERS = ["2048x768", "768x2048", "4096x6144", "14336x4096", "4096x28672", "8192x57344"]
DEFAULT_M = [1, 4, 16, 64, 128, 256, 1024]
KBITS = (2, 3, 4, 5)
BITS = {"cublas_fp16": 16.0, "tinygemm_int4": 4.25, "gemlite_w4": 4.25, "gemlite_w2": 2.25,
        "bnb_nf4": 4.5, **{f"kbit_k{k}": k + 0.25 for k in KBITS}}
PEERS = ("bnb_nf4", "tinygemm_int4", "gemlite_w4", "gemlite_w2")
TINYGEMM_MAX_M = 256  # a decode kernel: 0.09x cuBLAS at M = 128 (TARGETS.md); skipped above
GARBAGE = 0.8  # relative error above which an op is computing something else


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="kbit_gemm k=2..5 vs cuBLAS fp16, tinygemm, gemlite and bitsandbytes, "
                    "kernel-only (CUDA graphs) and eager, cold L2, one GPU (needs torch).")
    p.add_argument("--layers", nargs="+", default=DEFAULT_LAYERS, metavar="KxN",
                   help="layers as K_dim x N (default: " + " ".join(DEFAULT_LAYERS) + ")")
    p.add_argument("--m", nargs="+", type=int, default=DEFAULT_M, metavar="M",
                   help="rows of A (default 1 4 16 64 128 256 1024)")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS, metavar="PEER",
                   help="peers to run (default all): " + ", ".join(PEERS))
    p.add_argument("--gemlite-config", choices=("h100", "autotune"), default="h100",
                   help="where gemlite has no bundled configuration for this GPU: load the "
                        "H100's (default) or let it autotune")
    p.add_argument("--reps", type=int, default=30, help="eager reps per op (default 30)")
    p.add_argument("--graph-reps", type=int, default=20,
                   help="(overwrite, op) pairs per graph (default 20)")
    p.add_argument("--replays", type=int, default=7, help="graph replays timed (default 7)")
    p.add_argument("--no-eager", action="store_true", help="kernel-only figures alone")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.json and PREFIX.md")
    args = p.parse_args(argv)
    try:
        args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.layers]
        if any(len(s) != 2 or min(s) < 1 for s in args.shapes):
            raise ValueError
    except ValueError:
        p.error(f"--layers takes K_dim x N pairs such as 4096x28672, got {args.layers}")
    if min(args.m) < 1 or args.reps < 1 or args.graph_reps < 1 or args.replays < 1:
        p.error("M, reps, graph reps and replays must be >= 1")
    return args


# --------------------------------------------------------------------------
# the peers: each builder returns op(A16) -> result, or raises


def asymmetric_rtn(W16, nbits: int, group: int):
    """Round to nearest over groups of ``group`` along K: (q [N, K] in 0 .. 2^nbits - 1,
    lo and scale [N, K / group, 1], float32), so that w ~ q * scale + lo."""
    N, K = W16.shape
    w = W16.float().reshape(N, K // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    levels = 2 ** nbits - 1
    scale = ((hi - lo) / levels).clamp(min=1e-8)
    q = ((w - lo) / scale).round().clamp(0, levels).reshape(N, K)
    return q, lo, scale


def tinygemm_builder(torch, W16, group=128):
    """torch's int4 tinygemm: asymmetric RTN over groups of ``group`` along K (bf16 A)."""
    N, K = W16.shape
    q, lo, scale = asymmetric_rtn(W16, 4, group)
    q = q.to(torch.int32)
    zero = lo + 8 * scale  # tinygemm: w = (q - 8) * scale + zero
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    w_packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8.contiguous(), 8)
    sz = torch.cat([scale, zero], -1).reshape(N, K // group, 2).transpose(0, 1)
    sz = sz.contiguous().to(torch.bfloat16)  # [K / group, N, 2]
    del q, packed_u8

    def make(A16):
        A_bf = A16.to(torch.bfloat16)
        return lambda: torch._weight_int4pack_mm(A_bf, w_packed, group, sz)

    return make


def gemlite_builder(torch, W16, nbits, group=128):
    """gemlite A16Wn: asymmetric RTN int``nbits`` over groups of ``group``, fp16 scale/zero."""
    import gemlite

    N = W16.shape[0]
    q, lo, scale = asymmetric_rtn(W16, nbits, group)
    zero = -lo / scale  # gemlite (HQQ convention): w = (q - zero) * scale
    layer = gemlite.helper.A16Wn(device="cuda:0", dtype=torch.float16).from_weights(
        q.to(torch.uint8), scale.reshape(N, -1).half(), zero.reshape(N, -1).half(), nbits, group)
    del q

    def make(A16):
        return lambda: layer(A16)

    return make


def bnb_builder(torch, W16):
    """bitsandbytes NF4 (blocks of 64, fp32 absmax) through ``matmul_4bit``."""
    import bitsandbytes as bnb

    qW, state = bnb.functional.quantize_4bit(W16, blocksize=64, quant_type="nf4")

    def make(A16):
        return lambda: bnb.matmul_4bit(A16, qW.t(), quant_state=state)

    return make


def setup_gemlite(torch, choice: str) -> str:
    """Load gemlite's configuration the way ``--gemlite-config`` says; returns what was done."""
    import gemlite
    from gemlite import core

    name = torch.cuda.get_device_properties(0).name
    tag = core.get_default_cache_config()
    if tag is not None:
        return f"gemlite {gemlite.__version__}: its bundled {os.path.basename(tag)} for {name}"
    if choice == "autotune":
        return f"gemlite {gemlite.__version__}: no bundled config for {name}; autotuned"
    path = os.path.join(os.path.dirname(core.__file__), "configs", "h100.json")
    gemlite.GemLiteLinear.load_config(path)
    return f"gemlite {gemlite.__version__}: no bundled config for {name}; the H100's loaded"


# --------------------------------------------------------------------------
# timing


def time_all(ops, br, args):
    """{name: (graph_us or None, eager_us or None)} for ``ops`` ({name: op launching on the
    current stream})."""
    from moe_vs_grouped_mm import torch_graph_time

    from kbit_cupy.bench import harness

    eager = {} if args.no_eager else harness.time_ops(ops, reps=args.reps, warmup=3)
    out = {}
    for name, op in ops.items():
        r = harness.time_graph(op, reps=args.graph_reps, warmup=2, replays=args.replays)
        g = r["median_us"] if r is not None else None
        if g is None and name in br.raw:
            print(f"{name}: CuPy's capture failed; capturing with torch.cuda.graph", flush=True)
            g = torch_graph_time(br.torch, br.raw[name], args.graph_reps, args.replays,
                                 harness.DEFAULT_FLUSH_BYTES)
        e = eager[name]["median_us"] if name in eager else None
        out[name] = (g, e)
    return out


def lead(times: dict, k: int):
    """kbit at k bits faster than every peer with as many bits per weight or more (None: no
    such peer measured)."""
    ours = times.get(f"kbit_k{k}")
    rivals = [t for n, t in times.items()
              if n in PEERS and t is not None and BITS[n] >= BITS[f"kbit_k{k}"]]
    if ours is None or not rivals:
        return None
    return bool(ours < min(rivals))


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


COLUMNS = ["layer", "M", "mode", "cublas_fp16_us", *(f"x_{n}" for n in PEERS),
           *(f"x_kbit_k{k}" for k in KBITS), *(f"lead_k{k}" for k in KBITS)]


def save(records, checks, errors, info, notes, args, final: bool):
    """Sort the records, write PREFIX.json / .md where --out asks (after every layer, so
    a run cut short keeps its finished layers; ``final``: also print the table).
    Returns (failed sanity checks, where kbit is behind a peer)."""
    from kbit_cupy.bench import harness

    records.sort(key=lambda r: (r["mode"] != "graph", args.layers.index(r["layer"]), r["M"]))
    bad = [c for c in checks if not c["ok"]]
    lost = [f"{r['layer']} M={r['M']} {r['mode']} k={k}" for r in records for k in KBITS
            if r.get(f"lead_k{k}") is False]
    if final:
        print()
        print("| " + " | ".join(COLUMNS) + " |")
        for r in records:
            print("| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |")
    if args.out:
        done = sorted({r["layer"] for r in records}, key=args.layers.index)
        meta = {**info, **notes, "method": harness.METHOD, "reps": args.reps,
                "graph_reps": args.graph_reps, "replays": args.replays,
                "bits_per_weight": BITS, "checks": checks, "errors": errors,
                "behind_a_peer": lost, "complete": final,
                "layers_done": " ".join(done) + ("" if final else " (run in progress or cut)"),
                "ratios": "x_* = cublas_fp16_us / op_us, kernel-only (graph) and eager rows; "
                          "lead_kN: kbit k=N faster than every peer with >= its bits per weight"}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=COLUMNS,
                              title="kbit_gemm vs cuBLAS fp16 and peers, one GPU, one process")
        if final:
            print(f"wrote {args.out}.json and {args.out}.md")
    return bad, lost


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("peers.py needs torch (with CUDA); it is not installed here.", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("peers.py needs a CUDA GPU visible to torch; none found.", file=sys.stderr)
        return 1
    import cupy as cp
    from moe_vs_grouped_mm import Bridge

    from kbit_cupy import kbit_gemm, quantize_weight
    from kbit_cupy.bench import harness

    torch.set_grad_enabled(False)
    t_start = time.time()
    br = Bridge(torch, cp)
    info = harness.gpu_info()
    notes, errors, checks, records = {}, [], [], []
    peers = list(args.peers)
    if "gemlite_w4" in peers or "gemlite_w2" in peers:
        try:
            notes["gemlite"] = setup_gemlite(torch, args.gemlite_config)
        except Exception as e:  # noqa: BLE001 - a peer that does not import is left out
            errors.append(f"gemlite: {type(e).__name__}: {e}")
            peers = [p for p in peers if not p.startswith("gemlite")]
    if "bnb_nf4" in peers:
        try:
            import bitsandbytes
            notes["bitsandbytes"] = f"bitsandbytes {bitsandbytes.__version__}"
        except Exception as e:  # noqa: BLE001
            errors.append(f"bitsandbytes: {type(e).__name__}: {e}")
            peers.remove("bnb_nf4")
    notes["torch"] = f"torch {torch.__version__}"
    print(f"{info['gpu']} {info['cc']}  commit {info['commit']}  " + "; ".join(notes.values()),
          flush=True)
    for msg in errors:
        print(f"ERROR {msg}", flush=True)

    for K, N in harness.progress(args.shapes, "layer"):
        label = f"{K}x{N}"
        gen = torch.Generator(device="cuda").manual_seed(0)
        W16 = (torch.randn((N, K), device="cuda", generator=gen) * 0.02).half()
        W_cp = cp.from_dlpack(W16)
        builders = {}
        for k in KBITS:
            try:
                w = quantize_weight(W_cp, k=k).prepare()
                cp.cuda.Device().synchronize()  # prepare() ran on the default stream
                builders[f"kbit_k{k}"] = ("kbit", w)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{label} kbit k={k}: {type(e).__name__}: {e}")
        for name in peers:
            try:
                b = (tinygemm_builder(torch, W16) if name == "tinygemm_int4"
                     else gemlite_builder(torch, W16, 4) if name == "gemlite_w4"
                     else gemlite_builder(torch, W16, 2) if name == "gemlite_w2"
                     else bnb_builder(torch, W16))
                builders[name] = ("torch", b)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{label} {name}: {type(e).__name__}: {e}")
                print(f"ERROR {errors[-1]}", flush=True)
        torch.cuda.synchronize()
        for M in args.m:
            try:
                gA = torch.Generator(device="cuda").manual_seed(M)
                A16 = torch.randn((M, K), device="cuda", generator=gA).half()
                A_cp = cp.from_dlpack(A16)
                C = cp.empty((M, N), cp.float16)
                br.raw = {"cublas_fp16": lambda A16=A16, W16=W16: torch.mm(A16, W16.t())}
                ops = {}
                for name, (kind, b) in builders.items():
                    if name == "tinygemm_int4" and M > TINYGEMM_MAX_M:
                        continue
                    if kind == "kbit":
                        ops[name] = lambda w=b, A=A_cp, C=C: kbit_gemm(A, w, out=C)
                    else:
                        br.raw[name] = b(A16)
                ops.update({n: br.on_cupy_stream(f) for n, f in br.raw.items()})
                if M == args.m[0]:
                    ref = (A16.float() @ W16.float().t()).double()
                    for name, op in ops.items():
                        try:
                            res = op()
                            cp.cuda.Device().synchronize()
                            got = (torch.from_dlpack(res) if isinstance(res, cp.ndarray)
                                   else res).double()
                            err = float((got - ref).norm() / ref.norm())
                        except Exception as e:  # noqa: BLE001
                            err = None
                            errors.append(f"{label} M={M} {name}: {type(e).__name__}: {e}")
                            print(f"ERROR {errors[-1]}", flush=True)
                        ok = err is not None and err <= GARBAGE
                        checks.append({"layer": label, "M": M, "op": name, "rel_err": err,
                                       "ok": ok})
                        print(f"check {label} M={M} {name:<14} rel err "
                              f"{'-' if err is None else f'{err:.3f}'} {'ok' if ok else 'FAILED'}",
                              flush=True)
                        if not ok:
                            ops.pop(name)
                            br.raw.pop(name, None)
                times = time_all(ops, br, args)
                for mode, col in (("graph", 0), ("eager", 1)):
                    t = {n: v[col] for n, v in times.items()}
                    base = t.get("cublas_fp16")
                    if base is None:
                        continue
                    rec = {"layer": label, "K_dim": K, "N": N, "M": M, "mode": mode,
                           "cublas_fp16_us": base}
                    for n in [*PEERS, *(f"kbit_k{k}" for k in KBITS)]:
                        rec[f"{n}_us"] = t.get(n)
                        rec[f"x_{n}"] = base / t[n] if t.get(n) else None
                    for k in KBITS:
                        rec[f"lead_k{k}"] = lead(t, k)
                    records.append(rec)
                    print(f"{label:<11} M={M:<5} {mode:<5} cuBLAS {fmt(base)} us | " + " ".join(
                        f"{n} {fmt(rec[f'x_{n}'])}x" for n in t if n != "cublas_fp16"),
                        flush=True)
                del A16, A_cp, C, ops, br.raw
            except Exception as e:  # noqa: BLE001 - keep going: one run on the device
                errors.append(f"{label} M={M}: {type(e).__name__}: {e}")
                print(f"ERROR {errors[-1]}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                cp.cuda.Device().synchronize()
        del builders, W16, W_cp
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        save(records, checks, errors, info, notes, args, final=False)  # a cut run keeps these

    bad, lost = save(records, checks, errors, info, notes, args, final=True)
    print(f"\nsanity: {len(checks) - len(bad)}/{len(checks)} ops within {GARBAGE} relative error")
    print("kbit behind a peer with as many bits or more at: " + (", ".join(lost) or "nowhere"))
    if errors:
        print(f"{len(errors)} errors: " + "; ".join(errors))
    print(f"total {time.time() - t_start:.0f} s")
    return 3 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
