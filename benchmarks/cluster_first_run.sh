#!/usr/bin/env bash
# The cluster split's (gemm_latency.cu, CLUSTER; kernel="cluster") first runs on
# a GPU, in two device calls of under 10 minutes each; results go to $OUT.
#   KBIT_COMMIT=<commit> bash benchmarks/cluster_first_run.sh check   # GPU tests, sanitizers
#   KBIT_COMMIT=<commit> bash benchmarks/cluster_first_run.sh bench   # the sweep (H100 or H200)
#   KBIT_COMMIT=<commit> bash benchmarks/cluster_first_run.sh confirm # auto's cluster rows:
#     the GPU GEMM tests, then the small layers at 17..128 rows, fp16 (every geometry) and bf16
#     (QUICK=1: fp16, the geometry auto takes, at 17, 33, 48, 64 rows)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
commit=${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}
out=${OUT:-/tmp}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu" in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
echo "$gpu  commit $commit"
case "${1:-}" in
  check)
    timeout 240 python -m pytest -q tests/test_gpu_gemm.py tests/test_gpu_callpath.py -k cluster 2>&1 \
      | tee "$out/gpu_tests_cluster_${tag}_${commit}.txt" | tail -n 15
    for tool in memcheck racecheck; do  # (racecheck is the slower: 290 s on the H100)
      timeout $([ "$tool" = memcheck ] && echo 110 || echo 400) compute-sanitizer --tool "$tool" python benchmarks/sanitize_kernels.py --quick \
        --only cluster 2>&1 | tee "$out/sanitize_cluster_${tool}_${tag}_${commit}.txt" | tail -n 4
      # a sanitizer cut off by its limit prints only its header: say so in the file
      if [ "${PIPESTATUS[0]}" = 124 ]; then
        echo "TIMED OUT: no result" | tee -a "$out/sanitize_cluster_${tool}_${tag}_${commit}.txt"
      fi
    done ;;
  bench)
    timeout 540 python benchmarks/cluster_split.py --out "$out/cluster_${tag}_${commit}" 2>&1 \
      | tee "$out/cluster_${tag}_${commit}.log" | tail -n 60 ;;
  confirm)
    timeout 200 python benchmarks/warm_kernel_cache.py --families gemm_mma gemm_latency dequantize \
      quantize | tail -n 1
    timeout 250 python -m pytest -q -x tests/test_gpu_gemm.py tests/test_gpu_callpath.py 2>&1 \
      | tee "$out/gpu_tests_gemm_${tag}_${commit}.txt" | tail -n 4
    [ -n "${QUICK:-}" ] && small="--layers 2048x768 768x2048 2048x512 --m 17 33 48 64 --geometries cluster" \
      || small="--layers 2048x768 768x2048 2048x512 --m 17 32 48 64 128"
    name=cluster_${tag}_${commit}; [ -n "${QUICK:-}" ] && name=cluster_check_${tag}_${commit}
    timeout 170 python benchmarks/cluster_split.py $small --out "$out/$name" 2>&1 \
      | tee "$out/$name.log" | tail -n 30
    if [ -z "${QUICK:-}" ]; then
      timeout 100 python benchmarks/cluster_split.py $small --dtype bfloat16 --geometries cluster \
        --out "$out/cluster_${tag}_${commit}_bfloat16" 2>&1 \
        | tee "$out/cluster_${tag}_${commit}_bfloat16.log" | tail -n 30
    fi ;;
  *) echo "usage: $0 check|bench|confirm" >&2; exit 2 ;;
esac
