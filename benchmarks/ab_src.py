"""A/B of gemm_mma.cu against saved versions of it, in one process (device only).

usage: python benchmarks/ab_src.py BASE.cu[,OTHER.cu ...] [--set=NAME=INT ...]
       [--allow-different-bits] [K_dim N M k dtype ...]

"A" runs kbit_gemm with every gemm_mma kernel compiled from BASE.cu (e.g.
``git show HEAD~1:kernels_src/gemm_mma.cu > /tmp/base.cu``), "B" with the
working tree's kernels_src/gemm_mma.cu, further files after a comma under
their file stem. All are timed in one interleaved bench.time_ops call with
cuBLAS fp16, so drift cancels, and all must give B's bits (the change under
test must not change results) unless --allow-different-bits, which only asks
for a relative difference below 5e-3. Each --set adds "B@NAME=INT": B with
kbit_cupy.gemm.NAME set to INT during its launches (a dispatch knob such as
_STREAM_K_SLACK; the work split then sums in another order, so only closeness is
checked).
"""

import sys
from pathlib import Path

import cupy as cp
import numpy as np

import kbit_cupy as kc
from kbit_cupy import _jit, gemm
from kbit_cupy._arrays import BFLOAT16
from kbit_cupy.bench import harness as bench

_real_get_kernel = _jit.get_kernel


def base_getter(path):
    src = _jit.render_source("gemm_mma", Path(path).read_text())
    cache = {}

    def get_kernel(family, *args):
        if family != "gemm_mma":
            return _real_get_kernel(family, *args)
        if len(args) == 9 and "bool FOLD" not in src:  # a source from before the fold (70115ef)
            args = args[:8]  # its unfolded kernel (the same bits)
        name = _jit.kernel_name(family, *args)
        if name not in cache:
            cache[name] = cp.RawModule(code=src, options=_jit.compile_options(),
                                       name_expressions=[name]).get_function(name)
        return cache[name]

    return get_kernel


def run(get_kernel, A, w, out, knob=None):
    _jit.get_kernel = get_kernel
    saved = None
    if knob:
        saved = (knob[0], getattr(gemm, knob[0]))
        setattr(gemm, *knob)
    try:
        kc.kbit_gemm(A, w, out=out, kernel="mma")
    finally:
        _jit.get_kernel = _real_get_kernel
        if saved:
            setattr(gemm, *saved)


def case(getters, knobs, exact, K_dim, N, M, k, dtype):
    rng = cp.random.default_rng(0)
    W = (rng.standard_normal((N, K_dim), dtype=cp.float32) * 0.02).astype(cp.float16)
    w = kc.quantize_weight(W, k=k).prepare()
    del W
    A = rng.standard_normal((M, K_dim), dtype=cp.float32).astype(dtype)
    names = [*getters, "B"]
    outs = {n: cp.empty((M, N), dtype) for n in names}
    ops = {"cublas": bench.cublas_fp16_matmul_op(M, N, K_dim)[0]}
    for n in names:
        get = getters.get(n, _real_get_kernel)
        ops[n] = lambda g=get, o=outs[n]: run(g, A, w, o)
    for name, value in knobs:
        label = f"B@{name}={value}"
        outs[label] = cp.empty((M, N), dtype)
        ops[label] = lambda o=outs[label], kn=(name, value): run(_real_get_kernel, A, w, o, kn)
    for op in ops.values():
        op()
    same = all(bool(cp.array_equal(outs[n].view(cp.uint16), outs["B"].view(cp.uint16)))
               for n in names)
    ref = outs["B"].astype(cp.float32)
    rel = max(float(cp.linalg.norm(outs[n].astype(cp.float32) - ref) / cp.linalg.norm(ref))
              for n in names)
    res = bench.time_ops(ops, reps=30)
    t = {n: r["median_us"] for n, r in res.items()}
    line = " ".join(f"{n} {v:.1f} us ({t['cublas'] / v:.2f}x)" for n, v in t.items())
    print(f"{K_dim}x{N} M={M} k={k} {dtype.name}: {line}  B/A {t['A'] / t['B']:.3f}"
          f"  same bits: {same} (max relative difference {rel:.1e})", flush=True)
    if exact:
        assert same, "the variants disagree (--allow-different-bits for numerics changes)"
    else:
        assert rel < 5e-3, "the variants disagree"
    for name, value in knobs:
        o = outs[f"B@{name}={value}"].astype(cp.float32)
        assert float(cp.abs(o - outs["B"].astype(cp.float32)).max()) < 1e-2, name


def main():
    exact = "--allow-different-bits" not in sys.argv
    knobs = [(a[6:].split("=")[0], int(a[6:].split("=")[1])) for a in sys.argv[2:]
             if a.startswith("--set=")]
    rest = [a for a in sys.argv[2:] if not a.startswith("--")]
    files = sys.argv[1].split(",")
    getters = {"A": base_getter(files[0])}
    getters.update({Path(f).stem: base_getter(f) for f in files[1:]})
    args = rest or ["8192", "57344", "1", "4", "float16"]
    for i in range(0, len(args), 5):
        K_dim, N, M, k = (int(v) for v in args[i: i + 4])
        dtype = np.dtype(np.float16) if args[i + 4] == "float16" else BFLOAT16
        case(getters, knobs, exact, K_dim, N, M, k, dtype)


if __name__ == "__main__":
    main()
