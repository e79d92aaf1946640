"""Quantize / dequantize kernel bandwidth against the copy bandwidth of the same run.

``python -m kbit_cupy bench-format [--elements N] [--out PREFIX]``: for k = 2..5
and fp16 / bf16, times the quantize kernel (fp16/bf16 input) and the dequantize
kernel (fp16/bf16 output) with the TARGETS.md method (``harness.time_ops``:
cold L2, events, median) and as CUDA graphs, and reports bytes read + written
per second as a fraction of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import numpy as np

from .._arrays import BFLOAT16
from ..format import create_normal_float_codebook, nblocks_for
from ..quantize import _dequantize_cuda, _plan_for, _quantize_cuda
from . import harness

TARGET_DEQUANT = 0.85  # fraction of copy bandwidth (TARGETS.md)
TARGET_QUANT = 0.60


def run(args) -> int:
    import cupy as cp

    n = int(args.elements)
    reps = int(args.reps)
    info = harness.gpu_info()
    copy_bw = harness.copy_bandwidth(1 << 30)
    print(f"{info['gpu']} {info['cc']}  commit {info['commit']}  copy {copy_bw / 1e12:.3f} TB/s")
    rng = cp.random.default_rng(0)
    records = []
    dtypes = {"float16": np.float16, "bfloat16": BFLOAT16}
    for dtype_name, dtype in harness.progress(list(dtypes.items()), "dtype"):
        x = rng.standard_normal(n, dtype=cp.float32).astype(dtype)
        out = cp.empty(n, dtype)
        for k in (2, 3, 4, 5):
            cb = create_normal_float_codebook(k)
            plan = _plan_for(k, cb.tobytes())
            nblocks = nblocks_for(n)
            packed = cp.empty(nblocks * k, cp.uint32)
            absmax = cp.empty(nblocks, cp.uint8)
            flags = cp.zeros(1, cp.int32)
            cb_dev = cp.asarray(cb)

            def quantize(x=x, k=k, cb=cb, plan=plan, outs=(packed, absmax, flags)):
                return _quantize_cuda(x, k, cb, plan, "e4m4", outputs=outs)

            def dequantize(k=k, packed=packed, absmax=absmax, cb_dev=cb_dev, out=out):
                _dequantize_cuda(packed, absmax, cb_dev, k, n, out)

            quantize()
            assert int(flags.get()[0]) == 0
            times = harness.time_ops({"quantize": quantize, "dequantize": dequantize}, reps=reps)
            graphs = {name: harness.time_graph(fn, reps=20, replays=5)
                      for name, fn in (("quantize", quantize), ("dequantize", dequantize))}
            qdata = packed.nbytes + absmax.nbytes
            moved = {"quantize": x.nbytes + qdata, "dequantize": qdata + out.nbytes}
            for name in ("quantize", "dequantize"):
                t_us = times[name]["median_us"]
                graph_us = graphs[name]["median_us"] if graphs[name] else float("nan")
                bw = moved[name] / (t_us * 1e-6)
                target = TARGET_QUANT if name == "quantize" else TARGET_DEQUANT
                records.append({
                    "kernel": name, "k": k, "dtype": dtype_name, "elements": n,
                    "bytes": moved[name], "time_us": t_us, "graph_us": graph_us,
                    "GB_s": bw / 1e9, "copy_frac": bw / copy_bw,
                    "graph_copy_frac": moved[name] / (graph_us * 1e-6) / copy_bw,
                    "target": target, "meets": bw / copy_bw >= target,
                })
                r = records[-1]
                print(f"{name:<10} k={k} {dtype_name:<8} {t_us:9.1f} us  {r['GB_s']:7.0f} GB/s "
                      f"{100 * r['copy_frac']:5.1f}% of copy (graph {100 * r['graph_copy_frac']:5.1f}%)"
                      f"  target {100 * target:.0f}%  {'ok' if r['meets'] else 'MISSED'}")
        del x, out
    if args.out:
        meta = {**info, "copy_bandwidth_TB_s": copy_bw / 1e12, "method": harness.METHOD,
                "reps": reps}
        harness.write_results(records, meta, f"{args.out}.json", f"{args.out}.md",
                              columns=["kernel", "k", "dtype", "elements", "time_us", "graph_us",
                                       "GB_s", "copy_frac", "graph_copy_frac", "target", "meets"],
                              title="kbit quantize / dequantize kernel bandwidth")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0 if all(r["meets"] for r in records) else 1
