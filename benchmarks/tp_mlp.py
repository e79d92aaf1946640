"""Tensor-parallel k-bit MLP on 1..8 GPUs: time per call against one GPU, and the all-reduce share.

    python benchmarks/tp_mlp.py --gpus 4              # Llama-3-70B MLP, M = 1, 16, 128
    python benchmarks/tp_mlp.py --gpus 1              # one GPU: the unsharded MLP, and one
                                                      # rank's compute of a 2/4/8-way split
    python benchmarks/tp_mlp.py --gpus 2 --hidden 1024 --intermediate 2816   # quick check

The MLP is ``down(silu(gate(x)) * up(x))``, Llama-3-70B sizes by default
(hidden 8192, intermediate 28672: gate_up 8192 -> 57344, down 28672 -> 8192),
k = 4, fp16. ``--gpus N`` (N >= 2) starts one process per GPU
(``kbit_cupy.parallel.run_on_gpus``: the NCCL unique id is made here and
passed to them). Every rank quantizes the same seeded weights, keeps its
shard (``shard_mlp``: gate_up column-parallel, down row-parallel) and runs
``TensorParallelMLP`` (one all-reduce per call). Rank 0 also runs the
unsharded MLP on its GPU, the one-GPU baseline, and checks both against a
float32 reference (FORMAT.md section 7 bounds, doubled for two products).

Per M: time per call eager and as a CUDA graph (``--no-graph`` skips it),
the all-reduce alone on the MLP's output ``[M, hidden]`` and its share of
the TP call, the one-GPU time and the speedup. Timings are CUDA events over
``--reps`` calls after ``--warmup``, the GPUs lined up by a barrier first.
Keep NVLink multicast off (NCCL_NVLS_ENABLE=0 is set unless the environment
sets it). Prints a markdown table and one JSON line; ``--out FILE`` writes
the JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kbit_cupy as kc
from kbit_cupy import parallel

TOL = {"float16": 2e-3, "bfloat16": 1e-2}


def _dtype(name: str):
    from kbit_cupy._arrays import BFLOAT16

    return np.dtype(np.float16) if name == "float16" else BFLOAT16


def _weights(cfg):
    """gate, up [I, H] and down [H, I], quantized, identical on every rank."""
    import cupy as cp

    rng = cp.random.default_rng(cfg["seed"])
    H, I = cfg["hidden"], cfg["intermediate"]
    out = []
    for shape in ((I, H), (I, H), (H, I)):
        W = (rng.standard_normal(shape, dtype=cp.float32) * 0.02).astype(cp.float16)
        out.append(kc.quantize_weight(W, k=cfg["k"]))
        del W
    return out


def _inputs(cfg, M):
    import cupy as cp

    rng = np.random.default_rng(cfg["seed"] + M)
    return cp.asarray(rng.standard_normal((M, cfg["hidden"])).astype(_dtype(cfg["dtype"])))


def _time_ms(call, cfg) -> float:
    """GPU time per call on the current stream (events around ``reps`` calls)."""
    import cupy as cp

    for _ in range(cfg["warmup"]):
        call()
    stream = cp.cuda.get_current_stream()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(cfg["reps"]):
        call()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / cfg["reps"]


def _graph_ms(call, cfg, barrier=None) -> float:
    """The same, the call captured once into a CUDA graph and replayed."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call()  # plans and kernels built outside the capture
        stream.synchronize()
        if barrier is not None:
            barrier()
        stream.begin_capture()
        kept = call()  # noqa: F841 - what the graph writes must outlive it
        graph = stream.end_capture()
        if barrier is not None:
            barrier()
        ms = _time_ms(lambda: graph.launch(stream), cfg)
    return ms


def _reference(x, gate, up, down):
    """float32 MLP from the dequantized weights (the accuracy yardstick)."""
    import cupy as cp

    x32 = x.astype(cp.float32)
    g = x32 @ gate.dequantize(np.float32).T
    u = x32 @ up.dequantize(np.float32).T
    a = g / (1 + cp.exp(-g)) * u
    return a @ down.dequantize(np.float32).T


def _rel(a, b) -> float:
    import cupy as cp

    a, b = a.astype(cp.float64), b.astype(cp.float64)
    return float(cp.linalg.norm(a - b) / max(float(cp.linalg.norm(b)), 1e-30))


def _one_gpu_rows(cfg, gate, up, down):
    """Rank 0's unsharded MLP per M: time eager / graph, error vs float32."""
    gate_up = kc.join_shards([gate, up], "column")
    rows = {}
    for M in cfg["M"]:
        x = _inputs(cfg, M)
        call = lambda x=x: parallel.mlp_reference(x, gate_up, down)
        y = call()
        rows[M] = {"one_gpu_ms": _time_ms(call, cfg),
                   "one_gpu_graph_ms": None if cfg["no_graph"] else _graph_ms(call, cfg),
                   "one_gpu_error": _rel(y, _reference(x, gate, up, down)), "y": y}
    return rows


def _rank(group, cfg):
    """One rank of the TP run; rank 0 also returns the one-GPU baseline."""
    import cupy as cp

    n, rank = group.size, group.rank
    gate, up, down = _weights(cfg)
    gate_up, down_shard = kc.shard_mlp(gate, up, down, n)[rank]
    mlp = kc.TensorParallelMLP(gate_up, down_shard, group, reduce_dtype=cfg["reduce_dtype"])
    token = cp.zeros(1, cp.float32)

    def barrier():
        group.all_reduce(token, cp.cuda.get_current_stream().ptr)
        cp.cuda.get_current_stream().synchronize()

    rows = {}
    for M in cfg["M"]:
        x = _inputs(cfg, M)
        y = mlp(x)
        barrier()
        tp_ms = _time_ms(lambda x=x: mlp(x), cfg)
        barrier()
        graph_ms = None if cfg["no_graph"] else _graph_ms(lambda x=x: mlp(x), cfg, barrier)
        barrier()
        out = cp.empty((M, cfg["hidden"]), dtype=_dtype(cfg["dtype"]))
        reduce_ms = _time_ms(lambda out=out: group.all_reduce(
            out, cp.cuda.get_current_stream().ptr), cfg)
        barrier()
        rows[M] = {"tp_ms": tp_ms, "tp_graph_ms": graph_ms, "allreduce_ms": reduce_ms, "y": y}
    if rank != 0:
        return None
    one = _one_gpu_rows(cfg, gate, up, down)
    result = []
    for M in cfg["M"]:
        x = _inputs(cfg, M)
        ref = _reference(x, gate, up, down)
        row = {"M": M, **{k: v for k, v in rows[M].items() if k != "y"},
               **{k: v for k, v in one[M].items() if k != "y"}}
        row["tp_error"] = _rel(rows[M]["y"], ref)
        row["tp_vs_one_gpu"] = _rel(rows[M]["y"], one[M]["y"])
        result.append(row)
    return result


def _single_gpu(cfg):
    """--gpus 1: the unsharded MLP, and rank 0's compute of each split (what
    one GPU of an n-way TP run computes, without the all-reduce)."""
    gate, up, down = _weights(cfg)
    one = _one_gpu_rows(cfg, gate, up, down)
    splits = {n: kc.shard_mlp(gate, up, down, n) for n in cfg["simulate"]}
    result = []
    for M in cfg["M"]:
        x = _inputs(cfg, M)
        row = {"M": M, **{k: v for k, v in one[M].items() if k != "y"}}
        ref = _reference(x, gate, up, down)
        for n, shards in splits.items():
            gu, d = shards[0]
            row[f"rank0_of_{n}_ms"] = _time_ms(
                lambda gu=gu, d=d, x=x: parallel.mlp_reference(x, gu, d), cfg)
            row[f"simulated_{n}_error"] = _rel(parallel.simulate_mlp(
                x, shards, reduce_dtype=cfg["reduce_dtype"]), ref)
        result.append(row)
    return result


def _table(cfg, rows) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.4g}"
    if cfg["gpus"] == 1:
        cols = ["M", "one_gpu_ms", "one_gpu_graph_ms", "one_gpu_error"]
        cols += [c for n in cfg["simulate"] for c in (f"rank0_of_{n}_ms", f"simulated_{n}_error")]
    else:
        cols = ["M", "tp_ms", "tp_graph_ms", "one_gpu_ms", "one_gpu_graph_ms", "speedup",
                "speedup_graph", "allreduce_ms", "allreduce_share", "tp_error", "one_gpu_error",
                "tp_vs_one_gpu"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=1, help="GPUs (one process each); 1: no NCCL")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=28672)
    p.add_argument("--k", type=int, default=4, choices=(2, 3, 4, 5))
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--M", default="1,16,128", help="comma-separated rows of x")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reduce-dtype", default="auto", choices=parallel.REDUCE_DTYPES)
    p.add_argument("--simulate", default="2,4,8",
                   help="with --gpus 1: shard counts whose rank-0 compute is timed")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    from kbit_cupy._arrays import gpu_available

    if not gpu_available():
        print("tp_mlp: needs CuPy and a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (see the device notes)
    cfg = {"gpus": a.gpus, "hidden": a.hidden, "intermediate": a.intermediate, "k": a.k,
           "dtype": a.dtype, "M": [int(m) for m in a.M.split(",")], "reps": a.reps,
           "warmup": a.warmup, "reduce_dtype": a.reduce_dtype, "no_graph": a.no_graph,
           "seed": a.seed, "simulate": [int(n) for n in a.simulate.split(",") if n]}
    if a.gpus < 1:
        p.error("--gpus must be >= 1")
    if a.gpus == 1:
        rows = _single_gpu(cfg)
    else:
        rows = parallel.run_on_gpus(_rank, a.gpus, cfg)[0]
        for row in rows:
            row["speedup"] = row["one_gpu_ms"] / row["tp_ms"]
            row["allreduce_share"] = row["allreduce_ms"] / row["tp_ms"]
            if row["tp_graph_ms"] and row["one_gpu_graph_ms"]:
                row["speedup_graph"] = row["one_gpu_graph_ms"] / row["tp_graph_ms"]
    bound = 2 * TOL[a.dtype]
    errors = [v for row in rows for key, v in row.items() if key.endswith("error")]
    import cupy as cp

    record = {"benchmark": "tp_mlp", "config": cfg, "device": cp.cuda.runtime.getDeviceProperties(
        0)["name"].decode(), "rows": rows, "within_bound": all(e <= bound for e in errors)}
    print(_table(cfg, rows))
    print(json.dumps(record))
    if a.out:
        from kbit_cupy._files import write_text

        write_text(a.out, json.dumps(record, indent=1) + "\n")
    if not record["within_bound"]:
        print(f"tp_mlp: an error is above {bound:g} (twice the FORMAT.md bound)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
