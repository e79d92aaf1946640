"""What a thread-block cluster barrier costs on this GPU (device only, sm_90).

A probe kernel launched as clusters of CL CTAs along y (``__cluster_dims__``,
128 threads, the dynamic shared memory asked for) times with the SM clock,
in thread 0 of every CTA, after a 256 MB overwrite (the TARGETS.md setting):

    arrive    barrier.cluster.arrive.relaxed at entry (rows "entry 1" only)
    bar.sync  a __syncthreads after one global load
    wait      barrier.cluster.wait after --work cycles of spinning (rows "entry 1")
    sync      a full barrier after the spin and one shared store, in the form
              --first names (0: arrive.release + wait.acquire, gemm_mma.cu's
              cluster_sync, which the pull-form cluster sum runs first)
    sync2     a second full barrier (arrive.relaxed + wait) right after, as
              the pull form's exit barrier
    skew      the latest entry of a cluster's CTAs after its first (global timer)

Medians over CTAs and launches, in cycles and (by the SM clock's rate, read
from the same launches' global timer) in us. NOTES-gemm.md, "What a cluster
barrier costs", has the H100's figures.

    PYTHONPATH=. python benchmarks/cluster_barrier_probe.py [--clusters 2 4 8] [--shared-kb 0 160] [--first 0..4]
"""

from __future__ import annotations

import argparse

import numpy as np

SOURCE = r"""
__device__ __forceinline__ unsigned long long clk() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  return c;
}
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
extern "C" __global__ void __cluster_dims__(1, CL, 1)
probe(unsigned long long* out, const unsigned* data, int entry_arrive, int work, int first) {
  const unsigned long long t0 = gtime(), c0 = clk();
  unsigned long long c1 = c0;
  if (entry_arrive) {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    c1 = clk();
  }
  const unsigned cta = blockIdx.x * gridDim.y + blockIdx.y;
  const unsigned v = __ldcg(data + (cta * 97u) % 4096u);
  const unsigned long long c2a = clk();
  __syncthreads();
  const unsigned long long c2 = clk();
  // spin `work` cycles past entry (stands for the kernel's main loop); v keeps the load live
  unsigned acc = v;
  while (clk() - c0 < (unsigned long long)work) acc = acc * 1664525u + 1013904223u;
  const unsigned long long c3 = clk();
  if (entry_arrive) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  const unsigned long long c4 = clk();
  __shared__ unsigned partial[128];
  partial[threadIdx.x] = acc;  // as the kernel's partial tile: a shared store before the barrier
  if (first == 1)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
                 "barrier.cluster.wait.aligned;" ::: "memory");
  else if (first == 2)
    asm volatile("fence.acq_rel.cluster;\n"
                 "barrier.cluster.arrive.relaxed.aligned;\n"
                 "barrier.cluster.wait.aligned;" ::: "memory");
  else if (first == 3)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
  else if (first == 4)
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.aligned;" ::: "memory");
  else
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
  const unsigned long long c5 = clk();
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
               "barrier.cluster.wait.aligned;" ::: "memory");
  const unsigned long long c6 = clk(), t6 = gtime();
  if (threadIdx.x == 0) {
    unsigned long long* o = out + cta * 8;
    o[0] = c1 - c0;  // arrive
    o[1] = c2 - c2a;  // __syncthreads after the load
    o[2] = c4 - c3;  // wait
    o[3] = c5 - c4;  // sync
    o[4] = c6 - c5;  // sync2
    o[5] = c6 - c0;  // cycles in all
    o[6] = t6 - t0;  // ns in all
    o[7] = t0 + (partial[(threadIdx.x + 1) & 127] == 12345u ? 1u : 0u);  // entry (ns; stores kept live)
  }
}
"""

FIELDS = ("arrive", "bar.sync", "wait", "sync", "sync2")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--shared-kb", nargs="+", type=int, default=[0, 160])
    p.add_argument("--groups", type=int, default=32, help="clusters along x")
    p.add_argument("--work", type=int, default=8000, help="cycles of spin before the waits")
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--first", type=int, default=0, choices=range(5),
                   help="the first full barrier: 0 arrive.release + wait.acquire, 1 arrive.relaxed + "
                        "wait, 2 fence.acq_rel.cluster + 1, 3 arrive.relaxed + wait.acquire, "
                        "4 arrive.release + wait")
    args = p.parse_args()

    import cupy as cp

    from kbit_cupy.bench import harness

    if cp.cuda.Device().compute_capability != "90":
        print("cluster_barrier_probe: needs an sm_90 GPU (H100, H200); this one is sm_"
              f"{cp.cuda.Device().compute_capability}")
        return 2
    info = harness.gpu_info()
    print(f"{info['gpu']}  commit {info.get('commit')}  128 threads a CTA, {args.groups} clusters "
          f"along x, spin {args.work} cycles, first barrier form {args.first}; medians over CTAs and {args.launches} launches")
    print(f"{'CL':>3} {'smem KB':>7} {'entry':>5} " + " ".join(f"{f:>15}" for f in FIELDS)
          + f" {'total':>15} {'skew':>8}")
    data = cp.arange(4096, dtype=cp.uint32)
    flush = cp.empty(64 << 20, cp.uint32)
    for cl in args.clusters:
        mod = cp.RawModule(code=SOURCE.replace("CL", str(cl)), options=("-std=c++17", "-arch=sm_90a"))
        kern = mod.get_function("probe")
        for kb in args.shared_kb:
            shared = kb * 1024
            kern.max_dynamic_shared_size_bytes = max(shared, 0)
            ctas = args.groups * cl
            out = cp.zeros((ctas, 8), cp.uint64)
            for entry in (0, 1):
                rows = []
                for _ in range(args.launches):
                    flush.fill(1)  # 256 MB written: L2 dirty, as the TARGETS.md method leaves it
                    kern((args.groups, cl, 1), (128,), (out, data, np.int32(entry), np.int32(args.work),
                                                          np.int32(args.first)),
                         shared_mem=shared)
                    cp.cuda.Device().synchronize()
                    rows.append(out.get())
                r = np.concatenate(rows)
                t0 = r[:, 7].astype(np.int64).reshape(-1, cl)  # CTA = x * CL + y: a cluster's CTAs adjacent
                skew = np.median(t0.max(axis=1) - t0.min(axis=1))
                rate = np.median(r[:, 5] / np.maximum(r[:, 6], 1))  # cycles per ns
                cells = [f"{np.median(r[:, i]):7.0f} {np.median(r[:, i]) / rate / 1e3:5.2f}us"
                         for i in range(5)]
                print(f"{cl:>3} {kb:>7} {entry:>5} " + " ".join(cells)
                      + f" {np.median(r[:, 5]):7.0f} {np.median(r[:, 6]) / 1e3:5.2f}us {skew / 1e3:6.3f}us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
