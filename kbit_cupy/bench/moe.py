"""The grouped expert product against cuBLAS fp16, TARGETS.md method, one process and run.

``python -m kbit_cupy bench-moe [--configs ...] [--t 1 8 32 128 512] [--k 4]
[--out PREFIX]``: for each mixture-of-experts configuration (experts, top-k,
expert weight shapes) and token count T, a uniform random router picks each
token's top-k distinct experts (seeded); the rows are grouped by expert and
timed, cold L2, in one interleaved ``harness.time_ops`` call:

- ``grouped``: ``kbit_grouped_gemm`` on the grouped rows (one launch,
  ``validate=False``: no offset check, no host round trip);
- ``moe_linear``: the whole routed call with ``validate=False`` (grouping on
  the GPU, the launch, results back in token order);
- ``cublas_batched``: one ``cupy.matmul`` over the experts that have tokens,
  each group padded to the largest (the fp16 weights of those experts
  gathered beforehand, outside the timing), weights ``[E, N, K_dim]`` as a
  linear layer stores them (transposed view);
- ``cublas_batched_kn``: the same with the weights stored ``[E, K_dim, N]``
  (transposed beforehand, outside the timing);
- ``cublas_loop``: one ``cupy.matmul`` per expert with tokens, back to back;
- ``cublas_strided``: the padded batch as one ``cublasGemmStridedBatchedEx``
  call made directly (fp16 in and out, fp32 compute, weights ``[E, N, K_dim]``),
  which CuPy's ``matmul`` does not reach on these shapes.

The issue's baseline (``speedup``) is the faster of ``cupy.matmul`` batched
and the loop; ``vs_strided`` compares with the direct strided-batched call,
the strongest cuBLAS form measured here. Bandwidth is over the
bytes of the experts actually touched (their k-bit indices and scales) plus
activations and outputs.
"""

from __future__ import annotations

import numpy as np

from ..experts import kbit_grouped_gemm, moe_linear, quantize_experts
from . import harness

# name -> (experts, top_k, [(N, K_dim) of each expert weight])
CONFIGS = {
    "e128_top8": (128, 8, [(1536, 2048), (2048, 768)]),
    "e512_top10": (512, 10, [(512, 2048), (2048, 512)]),
}
DEFAULT_T = [1, 8, 32, 128, 512]
_CUDA_R_16F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 68, -1  # cuBLAS enum values


def route(T: int, E: int, top_k: int, seed: int) -> np.ndarray:
    """``[T, top_k]`` distinct expert ids per token, uniform, seeded."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(E, size=top_k, replace=False) for _ in range(T)]).astype(np.int32)


def _case(W16, experts: dict, T: int, top_k: int) -> tuple[dict, dict]:
    """(ops to time, facts) for T routed tokens through experts ``W16`` ``[E, N, K_dim]``."""
    import cupy as cp

    E, N, K_dim = W16.shape
    ids = route(T, E, top_k, seed=T)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    active = np.flatnonzero(counts)
    x = cp.asarray(np.random.default_rng(1).standard_normal((T, K_dim))).astype(cp.float16)
    rows = x[cp.asarray(order // top_k)]  # grouped by expert
    R = rows.shape[0]
    d_ids, d_off = cp.asarray(ids), cp.asarray(offsets)
    out_rows = cp.empty((R, N), cp.float16)
    out_tokens = cp.empty((T, top_k, N), cp.float16)
    # cuBLAS (a): the active experts' fp16 weights, each group padded to the largest
    w_active_t = W16[cp.asarray(active)].transpose(0, 2, 1)
    pad = int(counts.max())
    a_pad = cp.zeros((active.size, pad, K_dim), cp.float16)
    for i, e in enumerate(active):
        a_pad[i, : counts[e]] = rows[offsets[e]:offsets[e + 1]]
    c_pad = cp.empty((active.size, pad, N), cp.float16)
    w_active_kn = cp.ascontiguousarray(w_active_t)  # the same, stored [E, K_dim, N]
    w_active = cp.ascontiguousarray(W16[cp.asarray(active)])  # [E_active, N, K_dim]
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)  # host scalars
    # cuBLAS (b): one call per expert with tokens
    c_loop = cp.empty((R, N), cp.float16)
    spans = [(int(offsets[e]), int(offsets[e + 1]), W16[int(e)].T) for e in active]

    def batched():
        cp.matmul(a_pad, w_active_t, out=c_pad)

    def batched_kn():
        cp.matmul(a_pad, w_active_kn, out=c_pad)

    def strided():
        # column-major: C^T[b] (N x pad) = W[b] (K x N col-major, transposed) @ A^T[b] (K x pad)
        cublas.gemmStridedBatchedEx(
            handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, pad, K_dim, one.ctypes.data,
            w_active.data.ptr, _CUDA_R_16F, K_dim, N * K_dim,
            a_pad.data.ptr, _CUDA_R_16F, K_dim, pad * K_dim, zero.ctypes.data,
            c_pad.data.ptr, _CUDA_R_16F, N, pad * N, int(active.size), _CUBLAS_COMPUTE_32F,
            _CUBLAS_GEMM_DEFAULT)

    def loop():
        for r0, r1, wt in spans:
            cp.matmul(rows[r0:r1], wt, out=c_loop[r0:r1])

    batched()
    want = c_pad.copy()
    strided()
    if not cp.allclose(c_pad, want, rtol=1e-2, atol=1e-2):  # the hand-made call is right
        raise RuntimeError("cublasGemmStridedBatchedEx baseline disagrees with cupy.matmul")
    ops = {"cublas_batched": batched, "cublas_batched_kn": batched_kn, "cublas_loop": loop,
           "cublas_strided": strided}
    for k, ex in experts.items():
        ops[f"k{k}_grouped"] = (lambda ex=ex: kbit_grouped_gemm(
            rows, ex, d_off, out=out_rows, validate=False))
        ops[f"k{k}_moe_linear"] = (lambda ex=ex: moe_linear(
            x, d_ids, ex, out=out_tokens, validate=False))
    facts = {"rows": R, "active_experts": int(active.size), "max_rows": pad}
    return ops, facts


def run(args) -> int:
    import cupy as cp

    info = harness.gpu_info()
    copy_bw = harness.copy_bandwidth(1 << 30)
    print(f"{info['gpu']} {info['cc']}  commit {info['commit']}  copy {copy_bw / 1e12:.3f} TB/s")
    records = []
    for name in args.configs:
        E, top_k, shapes = CONFIGS[name]
        for N, K_dim in shapes:
            rng = cp.random.default_rng(0)
            W16 = (rng.standard_normal((E, N, K_dim), dtype=cp.float32) * np.float32(0.02)
                   ).astype(cp.float16)
            experts = {k: quantize_experts(W16, k).prepare() for k in args.k}
            for T in harness.progress(args.t, f"{name} {N}x{K_dim}"):
                ops, facts = _case(W16, experts, T, top_k)
                times = harness.time_ops(ops, reps=args.reps)
                base = min(times[n]["median_us"]
                           for n in ("cublas_batched", "cublas_batched_kn", "cublas_loop"))
                t_strided = times["cublas_strided"]["median_us"]
                R, active = facts["rows"], facts["active_experts"]
                act_bytes = 2 * (R * K_dim + R * N)
                for op_name, r in times.items():
                    t = r["median_us"]
                    if op_name.startswith("cublas"):
                        k, nbytes = 16, active * N * K_dim * 2 + act_bytes
                    else:
                        k = int(op_name[1])
                        nbytes = active * experts[k].expert_nbytes + act_bytes
                    rec = {
                        "config": name, "E": E, "top_k": top_k, "N": N, "K_dim": K_dim, "T": T,
                        **facts, "op": op_name, "k": k, "time_us": t, "speedup": base / t,
                        "vs_strided": t_strided / t,
                        "GB_s": nbytes / t / 1e3, "copy_frac": nbytes / (t * 1e-6) / copy_bw,
                    }
                    records.append(rec)
                    print(f"{name} {N}x{K_dim} T={T:<4} {op_name:<16} {t:9.1f} us  "
                          f"{rec['speedup']:5.2f}x ({rec['vs_strided']:5.2f}x strided) "
                          f"{rec['GB_s']:7.0f} GB/s "
                          f"({100 * rec['copy_frac']:4.1f}% of copy)")
                del ops
            del W16, experts
    if args.out:
        meta = {**info, "copy_bandwidth_TB_s": copy_bw / 1e12, "method": harness.METHOD,
                "reps": args.reps,
                "baseline": "speedup: the faster of cupy.matmul batched (padded; [E,N,K] view "
                            "or [E,K,N]) and per-expert cupy.matmul; vs_strided: one direct "
                            "cublasGemmStridedBatchedEx call"}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["config", "N", "K_dim", "T", "active_experts", "max_rows",
                                       "op", "k", "time_us", "speedup", "vs_strided", "GB_s",
                                       "copy_frac"],
                              title="Grouped expert product (kbit) vs cuBLAS fp16")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0
