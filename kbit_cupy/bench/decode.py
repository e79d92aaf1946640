"""``python -m kbit_cupy bench-decode``: a decode step of a Llama-3-8B-shaped
model, and the host cost of each public GPU call (issue 18).

The step: 32 layers x {4096->6144 (qkv), 4096->4096 (o), 4096->28672
(gate_up), 14336->4096 (down)} = 224 linear calls with random weights, at
M = 1, 4, 16, 64 rows, for fp16 (cuBLAS) and k = 2, 3, 4. Each form is timed

- eager: the step's calls issued back to back from Python, events around the
  step (host cost shows where it exceeds the GPU time); fp16 eager is
  ``cupy.matmul``, what a CuPy user writes;
- graph: the step captured once as a CUDA graph and replayed; fp16 through
  the capturable cuBLAS call (``_launch.cublas_gemm``: ``cupy.matmul``
  refuses capture).

The weights are distinct per layer (the step streams ~16 GB of fp16 or
~2-4 GB of k-bit weights, far past L2), so every step reads them cold.

Host cost: the median over ``calls`` back-to-back calls of one public call
(its plan built by a first call), each timed with ``perf_counter_ns``, in
batches of 200 with a synchronisation between batches (so the GPU queue
never fills and the figure is the host's own).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

LLAMA3_8B_LAYER = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
                   ("down", 14336, 4096))  # (name, K_dim, N)
LAYERS = 32


def host_cost_us(call, calls: int = 10_000, batch: int = 200) -> float:
    """Median host time of ``call()`` in microseconds (see module docstring)."""
    import cupy as cp

    call()
    cp.cuda.get_current_stream().synchronize()
    samples = []
    done = 0
    while done < calls:
        n = min(batch, calls - done)
        for _ in range(n):
            t0 = time.perf_counter_ns()
            call()
            samples.append(time.perf_counter_ns() - t0)
        cp.cuda.get_current_stream().synchronize()
        done += n
    return statistics.median(samples) / 1e3


def _events_us(run, reps: int) -> float:
    """Median over ``reps`` of ``run()`` timed with events on the current stream."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        run()
        e1.record(stream)
        e1.synchronize()
        times.append(1e3 * cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(times))


def _random_fp16(cp, shape, seed):
    rs = cp.random.RandomState(seed)
    return (rs.standard_normal(shape, dtype=cp.float32) * np.float32(0.02)).astype(cp.float16)


def decode_step(bits: list, rows: list, reps: int = 20, layers: int = LAYERS) -> list[dict]:
    """Time the decode step (see module docstring). ``bits``: "fp16" and/or
    k values. Returns one record per (form, M)."""
    import cupy as cp

    from .. import _launch
    from ..gemm import kbit_gemm, quantize_weight

    stream = cp.cuda.Stream(non_blocking=True)
    records = []
    with stream:
        for form in bits:
            weights = []
            for layer in range(layers):
                for j, (_, K_dim, N) in enumerate(LLAMA3_8B_LAYER):
                    W = _random_fp16(cp, (N, K_dim), seed=4 * layer + j)
                    weights.append(W if form == "fp16" else quantize_weight(W, k=int(form)))
                    del W
            for M in rows:
                acts = {K: _random_fp16(cp, (M, K), seed=K) for K in (4096, 14336)}
                outs = [cp.empty((M, N), cp.float16)
                        for _ in range(layers) for (_, _, N) in LLAMA3_8B_LAYER]
                shapes = [(K, N) for _ in range(layers) for (_, K, N) in LLAMA3_8B_LAYER]

                layer_calls = list(zip(weights, shapes, outs))
                if form == "fp16":
                    def eager(layer_calls=layer_calls, acts=acts):
                        for W, (K, _), C in layer_calls:
                            cp.matmul(acts[K], W.T, out=C)

                    def capturable(layer_calls=layer_calls, acts=acts, M=M):
                        s = stream.ptr
                        for W, (K, N), C in layer_calls:
                            _launch.cublas_gemm(M, N, K, "float16", acts[K].data.ptr,
                                                W.data.ptr, C.data.ptr, s)
                else:
                    def eager(layer_calls=layer_calls, acts=acts):
                        for w, (K, _), C in layer_calls:
                            kbit_gemm(acts[K], w, out=C)
                    capturable = eager
                eager()
                capturable()
                stream.synchronize()
                eager_us = _events_us(eager, reps)
                stream.begin_capture()
                capturable()
                graph = stream.end_capture()
                graph.upload(stream)
                graph.launch(stream)
                graph_us = _events_us(functools.partial(graph.launch, stream), reps)
                t0 = time.perf_counter_ns()
                for _ in range(3):
                    eager()
                host_us = (time.perf_counter_ns() - t0) / 3e3 / len(weights)
                stream.synchronize()
                records.append({"form": str(form), "M": M, "eager_us": eager_us,
                                "graph_us": graph_us, "host_us_per_call": host_us,
                                "calls": len(weights)})
                print(f"{form!s:>5} M={M:<3} eager {eager_us:9.1f} us  graph {graph_us:9.1f} us"
                      f"  host/call {host_us:6.1f} us", flush=True)
                graph = layer_calls = None
            weights = None
            cp.get_default_memory_pool().free_all_blocks()
    return records


def host_costs(calls: int = 10_000) -> list[dict]:
    """Host cost per call of each public GPU call next to cupy.matmul."""
    import cupy as cp

    import kbit_cupy as kc

    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    records = []

    def add(name, layer, M, call):
        us = host_cost_us(call, calls)
        records.append({"call": name, "layer": layer, "M": M, "host_us": us})
        print(f"{name:<34} {layer:<11} M={M:<3} {us:7.2f} us", flush=True)

    with stream:
        for K_dim, N in ((2048, 768), (4096, 28672)):
            W = _random_fp16(cp, (N, K_dim), seed=1)
            w = kc.quantize_weight(W, k=4)
            layer = f"{N}x{K_dim}"
            for M in (1, 16, 64):
                A = cp.asarray(rng.standard_normal((M, K_dim)).astype(np.float16))
                C = cp.empty((M, N), cp.float16)
                add("cupy.matmul (fp16)", layer, M, lambda A=A, W=W: cp.matmul(A, W.T))
                add("kbit_gemm (auto)", layer, M, lambda A=A, w=w: kc.kbit_gemm(A, w))
                add("kbit_gemm (auto, out=)", layer, M,
                    lambda A=A, C=C, w=w: kc.kbit_gemm(A, w, out=C))
            add("dequantize_kbit", layer, 0,
                lambda w=w: kc.dequantize_kbit(w.packed, w.absmax, w.codebook, 4, w.shape))
            add("quantize_kbit (validate=False)", layer, 0,
                lambda W=W: kc.quantize_kbit(W, k=4, validate=False))
        E, N, K_dim = 128, 1536, 2048
        ex = kc.quantize_experts(_random_fp16(cp, (E, N, K_dim), seed=3), k=4)
        for T in (1, 32):
            x = cp.asarray(rng.standard_normal((T, K_dim)).astype(np.float16))
            ids = cp.asarray(rng.integers(0, E, (T, 8)).astype(np.int32))
            rows = cp.asarray(rng.standard_normal((T * 8, K_dim)).astype(np.float16))
            offs = cp.asarray(np.searchsorted(np.sort(rng.integers(0, E, T * 8)),
                                              np.arange(E + 1)).astype(np.int32))
            add("kbit_grouped_gemm (validate=False)", f"{E}x{N}x{K_dim}", T,
                lambda rows=rows, offs=offs: kc.kbit_grouped_gemm(rows, ex, offs, validate=False))
            add("moe_linear (validate=False)", f"{E}x{N}x{K_dim}", T,
                lambda x=x, ids=ids: kc.moe_linear(x, ids, ex, validate=False))
    return records


def _markdown(meta: dict, steps: list[dict], costs: list[dict]) -> str:
    lines = [f"# bench-decode: {meta['gpu']}, commit {meta['commit']}", ""]
    if steps:
        lines += ["## Decode step (224 linear calls, Llama-3-8B shapes)", "",
                  ("| form | M | eager us | graph us | host us/call | eager vs fp16 eager | "
                   "graph vs fp16 graph |"), "|---|---:|---:|---:|---:|---:|---:|"]
        base = {r["M"]: r for r in steps if r["form"] == "fp16"}
        for r in steps:
            b = base.get(r["M"])
            e = f"{b['eager_us'] / r['eager_us']:.2f}x" if b else ""
            g = f"{b['graph_us'] / r['graph_us']:.2f}x" if b else ""
            lines.append(f"| {r['form']} | {r['M']} | {r['eager_us']:.0f} | {r['graph_us']:.0f} | "
                         f"{r['host_us_per_call']:.1f} | {e} | {g} |")
        lines.append("")
    if costs:
        lines += ["## Host cost per call (median of back-to-back calls)", "",
                  "| call | layer | M/T | host us |", "|---|---|---:|---:|"]
        for r in costs:
            lines.append(f"| {r['call']} | {r['layer']} | {r['M']} | {r['host_us']:.2f} |")
    return "\n".join(lines) + "\n"


def run(out: str | None, bits: list, rows: list, host: bool = True, step: bool = True,
        calls: int = 10_000) -> dict[str, Any]:
    """Run the benchmark; with ``out`` write ``OUT.json`` and ``OUT.md``."""
    from .harness import git_commit, gpu_info

    info = gpu_info()
    meta = {"gpu": info.get("gpu", "?"), "commit": git_commit(), "gpu_info": info}
    costs = host_costs(calls) if host else []
    steps = decode_step(bits, rows) if step else []
    result = {"meta": meta, "decode_step": steps, "host_cost": costs}
    if out:
        _write(Path(f"{out}.json"), json.dumps(result, indent=1, default=str))
        _write(Path(f"{out}.md"), _markdown(meta, steps, costs))
    return result


def _write(path: Path, text: str) -> None:
    """Write atomically (a temporary in the same directory, then rename)."""
    from .._files import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)
