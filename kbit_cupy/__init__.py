"""kbit_cupy: k-bit (k = 2..5) blockwise codebook quantization with CUDA kernels.

NumPy arrays in -> the NumPy path, NumPy out. CuPy arrays in -> CUDA kernels
compiled at run time by NVRTC, CuPy out. FORMAT.md is the contract.
"""

from .calibrate import (
    HessianAccumulator,
    allocate_bits,
    gptq_quantize,
    hessian_error,
    quantize_mixed,
    search_allocation,
)
from .codebook import fit_codebook
from .experts import KbitExperts, kbit_grouped_gemm, moe_linear, quantize_experts
from .format import create_normal_float_codebook, decode_absmax_e4m4, encode_absmax_e4m4
from .gemm import KbitWeight, kbit_gemm, quantize_weight, repack_for_gemm, unpack_from_gemm
from .parallel import (
    NcclGroup,
    ShardPlace,
    TensorParallelLinear,
    TensorParallelMLP,
    join_model,
    join_shards,
    load_shard,
    load_sharded,
    parallel_forward,
    run_on_gpus,
    save_shard,
    save_sharded,
    shard_mlp,
    shard_model,
    shard_weight,
    simulate_tensor_parallel,
)
from .quantize import dequantize_kbit, quantize_kbit
from .serialization import (
    load_quantized,
    load_quantized_model,
    read_safetensors,
    read_safetensors_metadata,
    save_quantized,
    write_safetensors,
)

__version__ = "0.1.0"

__all__ = [
    "HessianAccumulator",
    "KbitExperts",
    "KbitWeight",
    "NcclGroup",
    "ShardPlace",
    "TensorParallelLinear",
    "TensorParallelMLP",
    "allocate_bits",
    "create_normal_float_codebook",
    "decode_absmax_e4m4",
    "dequantize_kbit",
    "encode_absmax_e4m4",
    "fit_codebook",
    "gptq_quantize",
    "hessian_error",
    "join_model",
    "join_shards",
    "kbit_gemm",
    "kbit_grouped_gemm",
    "load_quantized",
    "load_quantized_model",
    "load_shard",
    "load_sharded",
    "moe_linear",
    "parallel_forward",
    "quantize_experts",
    "quantize_kbit",
    "quantize_mixed",
    "quantize_weight",
    "read_safetensors",
    "read_safetensors_metadata",
    "repack_for_gemm",
    "run_on_gpus",
    "save_quantized",
    "save_shard",
    "save_sharded",
    "search_allocation",
    "shard_mlp",
    "shard_model",
    "shard_weight",
    "simulate_tensor_parallel",
    "unpack_from_gemm",
    "write_safetensors",
]
