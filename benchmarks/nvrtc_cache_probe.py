"""Whether NVRTC answers a compile from a cache (ptxas does not run, so
--ptxas-options=-v reports nothing): one grouped Hopper variant compiled four
times in this process, with CUDA_CACHE_DISABLE set after NVRTC loaded, and
with a comment added to the source. Run it twice, the second time under
CUDA_CACHE_DISABLE=1 (results/nvrtc_cache_probe_h200_82fc7bd.txt; _jit.compile_check
acts on what it found).

    python benchmarks/nvrtc_cache_probe.py; CUDA_CACHE_DISABLE=1 python benchmarks/nvrtc_cache_probe.py
"""
import os
import uuid

from kbit_cupy import _jit


def main() -> None:
    wgs = _jit.gemm_grouped_wg_warpgroups(2, 4)
    v = _jit.Variant("gemm_mma", (4, "float16", "uint8", 2, 1, wgs, True))
    src = _jit.render_source("gemm_mma")
    opts = [*_jit.compile_options(), "-ftz=true", "--ptxas-options=-v", "-arch=sm_90a"]

    def report(tag: str, source: str) -> None:
        ok, log, _ = _jit._nvrtc_compile(source, [v.name], opts)
        print(tag, ok, len(log), "Compiling entry" in log)  # (ok, log chars, ptxas ran)

    report("plain (cached?)", src)
    os.environ["CUDA_CACHE_DISABLE"] = "1"
    report("env set after load", src)
    del os.environ["CUDA_CACHE_DISABLE"]
    report("nonce", src + f"\n// {uuid.uuid4().hex}\n")
    report("plain again", src)


if __name__ == "__main__":
    main()
