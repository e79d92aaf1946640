"""Probe (device, sm_90): how fast can a warp-per-stream kernel read DRAM?

usage: python benchmarks/stream_probe.py [--mbytes 320] [--chunk 2048] [--layer 8192x57344] [--kbit]
       [--graph] [--m 1 4 16] [--dtypes float16 bfloat16]

kbit_gemm's mma kernel at M=1 reads its weights the way `regs` does here:
each warp streams its own contiguous region in 2 KB chunks (k=4: one 16 x 256
tile), 16-byte loads per lane into registers, the next chunk loading while
the current one is consumed. Measured with the decode, the barriers, the
activations and the multiplies removed (scratch variants of the kernel), that
pattern alone took 104 us for the 250 MB of 8192x57344 at k=4 (2.4 TB/s),
and the whole kernel 113 us. This probe times the load pattern on its own,
against
- `regs`: the kernel's pattern (registers, one chunk ahead), CTAS_PER_SM CTAs
  of 4 warps per SM;
- `bulk`: each warp keeps STAGES chunks in flight in a shared-memory ring,
  filled by one lane with `cp.async.bulk` (the copy engine, completion on an
  mbarrier), read back with 16-byte LDS;
- `flat`: a grid-stride read of the whole buffer (16-byte loads, 4 per
  thread in flight: `flat_hint<4, 0>`).
Each kernel XORs what it reads into one word per thread (so nothing is
optimised away). Then the read ceiling of one layer: exactly its kbit bytes
(E4M4 scales) at k = 2..5, read by `flat_hint` over a grid of (CTAs per SM,
threads, 4 or 8 loads in flight per thread) with and without an L2
evict_first policy on the loads (after the TARGETS.md overwrite L2 is full of
dirty lines; a read that evicts them pays their write-back: 4096x28672's k=4
bytes 32.3 us plain, 28.0 us evict_first on the H100, `l2_hint_probe.py`),
the best of all printed next to cuBLAS fp16 at M=1 on that layer: the best
ratio any kernel that reads those bytes once could show. TARGETS.md method
(cold L2, events, median), one process.
"""

import argparse
import itertools

import cupy as cp

from kbit_cupy.bench import harness as bench

SRC = r"""
extern "C" __global__ void regs(const uint4* __restrict__ buf, long long words_per_warp,
                                int chunk_words, unsigned* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const uint4* p = buf + warp * words_per_warp;
  constexpr int per_lane = 4;  // 2 KB chunks: 4 16-byte words per lane (chunk_words == 128)
  uint4 cur[per_lane], nxt[per_lane];
  unsigned x = 0;
#pragma unroll
  for (int q = 0; q < per_lane; ++q) cur[q] = __ldg(p + q * 32 + lane);
  for (long long c = chunk_words; c <= words_per_warp; c += chunk_words) {
    if (c < words_per_warp) {
#pragma unroll
      for (int q = 0; q < per_lane; ++q) nxt[q] = __ldg(p + c + q * 32 + lane);
    }
#pragma unroll
    for (int q = 0; q < per_lane; ++q) x ^= cur[q].x ^ cur[q].y ^ cur[q].z ^ cur[q].w;
#pragma unroll
    for (int q = 0; q < per_lane; ++q) cur[q] = nxt[q];
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

// STAGES chunks of chunk_words 16-byte words per warp in dynamic shared memory.
extern "C" __global__ void bulk(const uint4* __restrict__ buf, long long words_per_warp,
                                int chunk_words, int stages, unsigned* __restrict__ out) {
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ __align__(8) unsigned long long bar[4][8];  // [warp][stage]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const uint4* p = buf + warp * words_per_warp;
  uint4* my = ring + (size_t)w * stages * chunk_words;
  const long long n_chunks = words_per_warp / chunk_words;
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) {
      unsigned a = (unsigned)__cvta_generic_to_shared(&bar[w][s]);
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::);
  }
  __syncwarp();
  auto issue = [&](long long c) {
    const int s = (int)(c % stages);
    const unsigned a = (unsigned)__cvta_generic_to_shared(&bar[w][s]);
    const unsigned d = (unsigned)__cvta_generic_to_shared(my + (size_t)s * chunk_words);
    const unsigned bytes = chunk_words * 16u;
    asm volatile("fence.proxy.async.shared::cta;" ::);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(d), "l"(p + c * chunk_words), "r"(bytes), "r"(a) : "memory");
  };
  if (lane == 0)
    for (int s = 0; s < stages - 1 && s < n_chunks; ++s) issue(s);
  unsigned x = 0;
  for (long long c = 0; c < n_chunks; ++c) {
    if (lane == 0 && c + stages - 1 < n_chunks) issue(c + stages - 1);
    const int s = (int)(c % stages);
    const unsigned a = (unsigned)__cvta_generic_to_shared(&bar[w][s]);
    const unsigned phase = (unsigned)((c / stages) & 1);
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT_%=;\n}\n" ::"r"(a), "r"(phase) : "memory");
    const uint4* src = my + (size_t)s * chunk_words;
    for (int q = lane; q < chunk_words; q += 32) {
      const uint4 v = src[q];
      x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();  // stage s is read before lane 0 refills it
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

extern "C" __global__ void empty() {}

// flat with UNROLL loads in flight per thread; HINT 1: an L2 evict_first
// policy on the loads, 2: that and no L1 allocation (l2_hint_probe.py).
template <int UNROLL, int HINT>
__global__ void flat_hint(const uint4* __restrict__ buf, long long n, unsigned* __restrict__ out) {
  unsigned long long policy = 0;
  if (HINT) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  const long long stride = (long long)gridDim.x * blockDim.x;
  unsigned x = 0;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint4* p = buf + i + u * stride;
      if (HINT == 1) {
        asm("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
            : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p), "l"(policy));
      } else if (HINT == 2) {
        asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
            : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p), "l"(policy));
      } else {
        v[u] = __ldg(p);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) x ^= __ldg(buf + i).x;
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}
"""
READ_GRIDS = ((1, 1024), (2, 1024), (4, 512), (4, 256), (8, 256), (8, 128), (16, 128))  # (CTAs/SM, threads)
HINTED = [f"flat_hint<{u}, {h}>" for u in (4, 8) for h in (0, 1)]  # the reads of a layer's bytes


def layer_words(K_dim: int, N: int, k: int) -> int:
    """16-byte words of a K_dim x N layer's kbit bytes at k (E4M4 scales)."""
    return int(N * K_dim * (k / 8 + 1 / 32)) // 16


def read_ceilings(K_dim: int, N: int, ks, reps: int) -> dict[int, float]:
    """{k: us} of the fastest read of the layer's kbit bytes at each k: every
    HINTED read over READ_GRIDS, each as CUDA graphs (harness.time_graph)."""
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=HINTED)
    kern = {n: mod.get_function(n) for n in HINTED}
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    words = {k: layer_words(K_dim, N, k) for k in ks}
    buf = cp.random.default_rng(0).integers(0, 2**31, size=max(words.values()) * 4, dtype=cp.uint32)
    outs = cp.zeros(sms * 16 * 1024, cp.uint32)
    best = {}
    for k in ks:
        times = []
        for (cps, threads), name in itertools.product(READ_GRIDS, HINTED):
            op = (lambda f=kern[name], g=sms * cps, t=threads, n=words[k], b=buf, o=outs:
                  f((g,), (t,), (b, cp.int64(n), o)))
            st = bench.time_graph(op, reps=reps)
            if st:
                times.append(st["median_us"])
        best[k] = min(times)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=int, default=320)
    ap.add_argument("--chunk", type=int, default=2048, help="bytes per chunk (multiple of 512)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layer", default="8192x57344", help="K_dim x N whose kbit bytes to read")
    ap.add_argument("--kbit", action="store_true", help="also time kbit_gemm (auto) at M=1 there")
    ap.add_argument("--m", nargs="+", type=int, default=[1],
                    help="with --kbit: rows of A to time kbit_gemm at (default 1)")
    ap.add_argument("--dtypes", nargs="+", default=["float16"], choices=["float16", "bfloat16"],
                    help="with --kbit: activation dtypes (default float16)")
    ap.add_argument("--graph", action="store_true",
                    help="kernel-only: each op as a CUDA graph of (overwrite, op) pairs minus the "
                         "overwrites (harness.time_graph); the layer's reads, an empty kernel (the "
                         "floor of any launch), cuBLAS through its capturable call, kbit_gemm")
    args = ap.parse_args()
    hinted = HINTED
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=hinted)
    k_regs, k_bulk = (mod.get_function(n) for n in ("regs", "bulk"))
    k_hint = {n: mod.get_function(n) for n in hinted}
    k_flat = k_hint["flat_hint<4, 0>"]  # the grid-stride read, 4 loads in flight, no policy
    k_empty = mod.get_function("empty")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    chunk_words = args.chunk // 16
    ops = {}
    outs = cp.zeros(sms * 32 * 2048, cp.uint32)
    total_words = args.mbytes * 2**20 // 16
    bufp = cp.random.default_rng(0).integers(0, 2**31, size=total_words * 4, dtype=cp.uint32)
    configs = {}
    for cps in (4, 5, 8) if args.chunk == 2048 else ():
        n_warps = sms * cps * 4
        wpw = total_words // n_warps // chunk_words * chunk_words
        configs[f"regs {cps} CTA/SM"] = (
            k_regs,
            (sms * cps,),
            (128,),
            (bufp, cp.int64(wpw), cp.int32(chunk_words), outs),
            0,
            wpw * n_warps * 16,
        )
    for cps, stages in ((2, 4), (2, 8), (3, 4), (4, 4), (4, 6)):
        n_warps = sms * cps * 4
        wpw = total_words // n_warps // chunk_words * chunk_words
        smem = 4 * stages * chunk_words * 16
        if cps * (smem + 1024) > 227 * 1024:
            continue
        k_bulk.max_dynamic_shared_size_bytes = max(k_bulk.max_dynamic_shared_size_bytes, smem)
        configs[f"bulk {cps} CTA/SM x {stages} stages"] = (
            k_bulk,
            (sms * cps,),
            (128,),
            (bufp, cp.int64(wpw), cp.int32(chunk_words), cp.int32(stages), outs),
            smem,
            wpw * n_warps * 16,
        )
    configs["flat"] = (
        k_flat,
        (sms * 8,),
        (256,),
        (bufp, cp.int64(total_words), outs),
        0,
        total_words * 16,
    )
    # The read ceiling for a layer's kbit bytes at each k, against cuBLAS fp16 at M=1.
    K_dim, N = (int(v) for v in args.layer.split("x"))
    read_sets = {}  # k -> names of its read configurations
    for k in (2, 3, 4, 5):
        words = layer_words(K_dim, N, k)
        if words > total_words:
            continue
        for (cps, threads), name in itertools.product(READ_GRIDS, hinted):
            cfg = f"read {args.layer} k={k} {name} {cps}x{threads}"
            read_sets.setdefault(k, []).append(cfg)
            configs[cfg] = (k_hint[name], (sms * cps,), (threads,), (bufp, cp.int64(words), outs),
                            0, words * 16)
    if args.graph:  # the layer's reads only (the whole-buffer patterns need no graph)
        configs = {n: c for n, c in configs.items() if n.startswith("read ")}
        configs["empty kernel (launch floor)"] = (k_empty, (1,), (32,), (), 0, 0)
    for name, (k, grid, block, kargs, smem, nbytes) in configs.items():
        ops[name] = lambda k=k, grid=grid, block=block, kargs=kargs, smem=smem: k(
            grid, block, kargs, shared_mem=smem
        )
    if args.graph:
        from kbit_cupy import _launch

        a16 = cp.ones((1, K_dim), cp.float16)
        w16 = cp.full((N, K_dim), 0.01, cp.float16)
        c16 = cp.empty((1, N), cp.float16)
        ops["cublas"] = lambda: _launch.cublas_gemm(1, N, K_dim, "float16", a16.data.ptr, w16.data.ptr,
                                                    c16.data.ptr, cp.cuda.get_current_stream().ptr)
    else:
        ops["cublas"] = bench.cublas_fp16_matmul_op(1, N, K_dim)[0]
    if args.kbit:
        import kbit_cupy as kc
        from kbit_cupy._arrays import BFLOAT16

        rng = cp.random.default_rng(1)
        W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16)
        kbit_ops = {}  # name -> k
        for k in (2, 3, 4, 5):
            w = kc.quantize_weight(W, k=k).prepare()
            cp.cuda.Device().synchronize()  # prepare() ran on the default stream
            for dtype_name in args.dtypes:
                dtype = {"float16": cp.float16, "bfloat16": BFLOAT16}[dtype_name]
                for M in args.m:
                    A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
                    out = cp.empty((M, N), dtype)
                    name = f"kbit_gemm {args.layer} k={k} M={M} {dtype_name}"
                    ops[name] = lambda w=w, A=A, out=out: kc.kbit_gemm(A, w, out=out)
                    configs[name] = (None, None, None, None, None, int(N * K_dim * (k / 8 + 1 / 32)))
                    kbit_ops[name] = k
        del W
    if args.graph:
        res = {name: bench.time_graph(op, reps=20) for name, op in ops.items()}
    else:
        res = bench.time_ops(ops, reps=args.reps)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    t_cublas = res["cublas"]["median_us"]
    print(
        f"{dev}, {args.mbytes} MB, chunk {args.chunk} B; cuBLAS fp16 {args.layer} M=1: "
        f"{t_cublas:.1f} us"
    )
    best = {k: min(names, key=lambda n: res[n]["median_us"]) for k, names in read_sets.items()}
    for k, name in best.items():  # the ceiling: the fastest read of the layer's bytes
        nbytes, t = configs[name][5], res[name]["median_us"]
        print(f"{'best read ' + args.layer + f' k={k}':32s} {t:8.1f} us  {nbytes / t / 1e6:5.2f} TB/s  "
              f"cuBLAS/this {t_cublas / t:5.2f}x  ({name.split(' ', 3)[3]})")
    for name, r in res.items():
        if name == "cublas" or name.startswith("read "):
            continue
        nbytes = max(configs[name][5], 1)
        k = kbit_ops.get(name) if args.kbit else None
        of_read = (f"  {res[best[k]]['median_us'] / r['median_us']:6.1%} of the read"
                   if k in best else "")
        vs_cublas = (f"cuBLAS/this {t_cublas / r['median_us']:5.2f}x"  # cuBLAS ran at M=1 only
                     if " M=" not in name or " M=1 " in name else " " * 18)
        print(f"{name:32s} {r['median_us']:8.1f} us  {nbytes / r['median_us'] / 1e6:5.2f} TB/s  "
              f"{vs_cublas}{of_read}")


if __name__ == "__main__":
    main()
