import os, sys, uuid
from kbit_cupy import _jit
v = _jit.Variant("gemm_mma", (4, "float16", "uint8", 2, 1, _jit.gemm_grouped_wg_warpgroups(2, 4), True))
src = _jit.render_source("gemm_mma")
opts = [*_jit.compile_options(), "-ftz=true", "--ptxas-options=-v", "-arch=sm_90a"]
def rep(tag, s):
    ok, log, low = _jit._nvrtc_compile(s, [v.name], opts)
    print(tag, ok, len(log), "Compiling entry" in log)
rep("plain (cached?)", src)
os.environ["CUDA_CACHE_DISABLE"] = "1"
rep("env set after load", src)
del os.environ["CUDA_CACHE_DISABLE"]
rep("nonce", src + f"\n// {uuid.uuid4().hex}\n")
rep("plain again", src)
