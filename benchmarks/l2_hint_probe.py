"""Probe (device): what an L2 cache policy on the weight loads buys, and what
the cold-L2 method's flush costs a read of a layer's bytes.

usage: python benchmarks/l2_hint_probe.py [--layers 4096x28672,8192x57344,2048x768]
       [--ms 1,16] [--reps 30]

The TARGETS.md method overwrites a 256 MB buffer before each op: L2 is then
full of dirty lines, which the op's own reads evict (a write-back to DRAM
while it reads). A read flush leaves L2 full of clean lines instead, as a
decode step does (the previous layers' weights). For each flush, in one
interleaved `time_ops` call per layer:
- flat reads of exactly the layer's k=4 bytes over a grid of (CTAs per SM,
  threads per CTA, 16-byte loads in flight per thread), with no L2 policy,
  with `createpolicy ... L2::evict_first` on every load, and with that plus
  `L1::no_allocate`: the best of each is printed;
- cuBLAS fp16 at each M;
- kbit_gemm (`auto`, k = 4) with its kernels compiled with
  KBIT_WEIGHT_L2_HINT = 0, 1 and 2 (mma_common.cuh): every weight and scale
  load without a policy, evict_first, evict_first + no L1 allocation.
The kbit_gemm variants must give the same bits (the hint changes no value).
"""

import argparse
import itertools

import cupy as cp
import stream_probe  # benchmarks/, the folder of this script
from define_ab import kbit_variant

import kbit_cupy as kc
from kbit_cupy.bench import harness as bench

SRC = stream_probe.SRC  # its flat_hint<UNROLL, HINT> kernel
HINTS = ("none", "evict_first", "evict_first+no_L1")
UNROLLS = (4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4096x28672,8192x57344,2048x768")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    names = [f"flat_hint<{u}, {h}>" for u in UNROLLS for h in range(3)]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    kern = {(u, h): mod.get_function(f"flat_hint<{u}, {h}>") for u in UNROLLS for h in range(3)}
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    out = cp.zeros(1, cp.uint32)
    big = cp.random.default_rng(0).integers(0, 2**31, size=(400 << 20) // 4, dtype=cp.uint32)
    read_flush = bench.read_flusher(256 << 20)

    ms = [int(m) for m in args.ms.split(",")]
    print(f"{dev}, commit {bench.git_commit()}")
    for layer in args.layers.split(","):
        K_dim, N = (int(v) for v in layer.split("x"))
        nbytes = int(N * K_dim * (4 / 8 + 1 / 32))
        words = nbytes // 16
        ops, info = {}, {}
        for (cps, threads), u, h in itertools.product(
            ((2, 1024), (4, 512), (8, 256), (16, 128), (4, 256), (8, 128), (1, 1024)), UNROLLS, range(3)
        ):
            name = f"flat cps={cps} thr={threads} unroll={u} {HINTS[h]}"
            ops[name] = lambda k=kern[(u, h)], g=sms * cps, t=threads, n=words: k(
                (g,), (t,), (big, cp.int64(n), out))
            info[name] = ("flat", h)
        rng = cp.random.default_rng(1)
        W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16)
        As = {m: rng.standard_normal((m, K_dim), dtype=cp.float32).astype(cp.float16) for m in ms}
        ws = {h: kbit_variant(W, 4, {"KBIT_WEIGHT_L2_HINT": h}, As.values()) for h in range(3)}
        outs = {}
        for m in ms:
            A = As[m]
            ops[f"cublas M={m}"] = bench.cublas_fp16_matmul_op(m, N, K_dim)[0]
            info[f"cublas M={m}"] = ("cublas", m)
            ref = None
            for h in range(3):
                o = cp.empty((m, N), cp.float16)
                with bench._bench_stream():
                    kc.kbit_gemm(A, ws[h], out=o)
                cp.cuda.Device().synchronize()
                if ref is None:
                    ref = o.copy()
                else:
                    assert bool((o.view(cp.uint16) == ref.view(cp.uint16)).all()), (layer, m, h)
                outs[(m, h)] = o
                name = f"kbit_gemm k=4 M={m} hint={HINTS[h]}"
                ops[name] = lambda A=A, w=ws[h], o=o: kc.kbit_gemm(A, w, out=o)
                info[name] = ("kbit", m, h)
        del W
        for flush_name, fn in (("write flush (TARGETS.md)", None), ("read flush (clean L2)", read_flush)):
            res = bench.time_ops(ops, reps=args.reps, flush_fn=fn)
            print(f"\n## {layer}, k=4 bytes {nbytes / 1e6:.1f} MB, {flush_name}")
            for h in range(3):
                best = min((n for n in ops if info[n] == ("flat", h)), key=lambda n: res[n]["median_us"])
                t = res[best]["median_us"]
                print(f"best read, {HINTS[h]:18s} {t:8.2f} us {nbytes / t / 1e6:5.2f} TB/s  ({best})")
            for m in ms:
                tc = res[f"cublas M={m}"]["median_us"]
                print(f"cuBLAS fp16 M={m:<3d} {tc:8.2f} us")
                for h in range(3):
                    t = res[f"kbit_gemm k=4 M={m} hint={HINTS[h]}"]["median_us"]
                    print(f"  kbit_gemm k=4 M={m:<3d} {HINTS[h]:18s} {t:8.2f} us  {tc / t:5.2f}x cuBLAS")
            flat_all = sorted((res[n]["median_us"], n) for n in ops if info[n][0] == "flat")
            print("  reads, fastest five:", "; ".join(f"{t:.2f} {n}" for t, n in flat_all[:5]))
        del ws, outs
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
