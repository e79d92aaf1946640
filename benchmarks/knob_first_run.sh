#!/usr/bin/env bash
# The first GPU runs of the two A/B knobs built offline (benchmarks/NOTES-gemm.md:
# "Half K tiles a warp in the latency launch" and "k = 5 at 256 rows a CTA"), in
# device calls of under 10 minutes each; results go to $OUT, one file a step.
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh check  # warm, GPU tests, sanitizers (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ab     # both A/Bs (~6 min)
# Where a knob wins, its default changes and the usual proof follows (the GPU
# tests, the sanitizers without the knob, full_sweep.py); this script is only
# the first look, so that it costs one or two calls.
set -u
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
commit=${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}
out=${OUT:-/tmp}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu" in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
echo "$gpu  commit $commit"
KSPLIT=KBIT_LATENCY_KSPLIT=2,_jit.GEMM_LATENCY_KSPLIT=2
K5=_jit.GEMM_WG_K5_FULL_ROWS=1

# run LIMIT FILE CMD...: CMD under a time limit, its output to $out/FILE (and the
# last lines here); a step cut off by its limit says so in its file
run() {
  local limit=$1 file=$out/$2; shift 2
  timeout "$limit" "$@" > "$file" 2>&1
  local rc=$?
  [ "$rc" = 124 ] && echo "TIMED OUT after $limit s: no complete result" >> "$file"
  echo "== $(basename "$file") (rc $rc)"; tail -n 6 "$file"
}

case "${1:-}" in
  check)
    run 150 warm_${tag}.txt python benchmarks/warm_kernel_cache.py \
      --families gemm_mma gemm_latency moe_route -j 16
    run 150 gpu_tests_knobs_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "half_k_tiles or k5_full or slab_chunks"
    run 100 sanitize_ksplit_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --only latency --define "$KSPLIT"
    run 100 sanitize_moe_ksplit_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --define "$KSPLIT"
    run 120 sanitize_k5_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --large-m --only wgmma --k 5 --define "$K5" ;;
  racecheck)  # the slower tool, after check passed (~6 min)
    run 200 sanitize_ksplit_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_kernels.py --quick --only latency --define "$KSPLIT"
    run 120 sanitize_moe_ksplit_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_moe.py --quick --define "$KSPLIT"
    run 200 sanitize_k5_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_kernels.py --quick --large-m --only wgmma --k 5 --define "$K5" ;;
  ab)
    run 200 define_ab_${tag}_ksplit_${commit}.txt python benchmarks/define_ab.py --define "$KSPLIT" \
      --layers 768x2048 2048x768 2048x512 4096x4096 4096x6144 --m 1 4 16 --k 2 3 4 5 --kernel latency
    run 90 moe_gap_probe_${tag}_ksplit_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 2048x1536 --t 1 2 --ab "$KSPLIT"
    run 200 define_ab_${tag}_k5_full_rows_${commit}.txt python benchmarks/define_ab.py --define "$K5" \
      --layers 4096x28672 14336x4096 8192x57344 28672x8192 --m 200 256 512 1024 2048 --k 5 \
      --kernel wgmma auto ;;
  *) echo "usage: $0 check|racecheck|ab" >&2; exit 2 ;;
esac
