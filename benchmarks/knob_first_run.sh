#!/usr/bin/env bash
# The GPU runs of the A/B knobs built offline (benchmarks/NOTES-gemm.md:
# "Half K tiles a warp in the latency launch", "k = 5 at 256 rows a CTA" and
# "The scale pair's factor in the codebook"; their first H200 runs: "The
# knobs' first GPU runs"), each step one device call of under 10 minutes;
# results go to $OUT, one file a step. k = 5 at 256 rows is on by default
# since 7cf8d0a: ab-k5 runs the A/B the other way (=0, the 192-row launches),
# for a GPU that has not run it (the H100).
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ab-ksplit  # KSPLIT 2 and 4 (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ab-k5      # k = 5 at 192 rows against 256 (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ab-fold    # the fold (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k5-mid     # k = 5, mid layers, 384..4096 rows (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh check      # GPU tests of all three (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh fold-check # GPU tests of the fold alone (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh chosen-ab  # the fold and the MoE half K tiles as
#       chosen, against off; on a GPU under 4 TB/s (the H100) the fold's bandwidth gate lowered (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ab-base    # the decode tables' address in a
#       register (KBIT_TAB_UNIFORM_BASE=0, as before) against the uniform one, dense and MoE (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh base-check # GPU tests of gemm and the call
#       path, memcheck of the 8- and 16-warp mma launches (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh base-rest  # test_experts, issue 25's table (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ksplit-ab  # the dense latency launch's half
#       K tiles against whole tiles, fp16 and bf16; the compile-test diagnosis (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ksplit-check # their GPU tests, memcheck (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ksplit-bound # the rule's bound: 2 and 5-7 warps an SM (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-ncu    # ncu of the grouped launch, T = 128 / 512 (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-knobs  # the grouped launch's warpgroups, mma.sync or wgmma (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh wg-desc    # uniform wgmma descriptors against the old ones (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh wg-desc-check # their GPU tests; moe_linear's routing at 4096 pairs (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-table  # issue 21's table, the rest of test_gpu_gemm, the bound in bf16 (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh wg-desc-sanitize # memcheck, racecheck of the wgmma launches (~7 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-quarter # the MoE few-pair launch at quarter K tiles (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh quad-store     # 8-byte C stores, located experts: A/B (~7 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh quad-store-dense  # the same stores on dense layers (~4 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh quad-store-check  # their GPU tests (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh quad-store-sanitize  # their memcheck, the rest of test_gpu_gemm (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh grouped-fold  # folded tables, row lookups at once: A/B (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh latency-cap   # the few-row launch's bound, Qwen3-235B at T = 1 (~2 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh route-batch   # moe_linear's routed ids 8 at a time: A/B (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh route-batch-check # test_experts, Qwen3-235B's bound at T = 1 (~7 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh route-cap     # in-launch routing past 4096 pairs: A/B; memcheck (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh route-slice   # odd id slices in the placement: A/B; issue 21's table (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh route-check   # test_experts, memcheck, two A/Bs at 512 experts T = 8, 32 (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-phases    # stamps of the grouped launch's set-up, moe_linear and grouped (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-phases2   # the placement's own stamps, with and without the prefetch (~4 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-early-tile # the first weight tile before the placement: A/B and stamps (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh early-tile-check # its GPU tests, sanitizers and a Qwen3-235B A/B (~10 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh early-tile-k  # the first tile early at k = 2, 3, 5 and bf16 against off (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh warp-search   # expert lookups by ballots against the binary search; test_experts (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh warp-search-sanitize # memcheck, racecheck of the grouped launches; issue 21's table (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-setup-ab  # the placement inlined: A/B (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-ncu-setup  # stall samples by instruction, moe_linear's set-up at 512 experts T = 8 (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh moe-ncu-source # stall samples by instruction, grouped launch (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh lut-ncu    # gemm_lut.cu on 8192x57344 k = 2 M = 1: ncu sections and stall samples by instruction (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh lut-check  # gemm_lut.cu: GPU tests, memcheck, racecheck, and against mma and latency, fp16 and bf16 (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh copy-warps-h100 # (the H100) A copied by four warps, the lone-CTA charge (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh copy-warps-ncu  # stall samples, four copying warps and every warp (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh grouped-copy-warps # the grouped launch's copies by four warps: A/B (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh no-bar-probe  # (wrong results) the mma launches without their per-tile barrier (~5 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh a-ring  # A's stages in an mbarrier ring: A/B, odd shapes (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh a-ring-auto  # the ring under kernel auto, k = 2..5 (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ring-check  # k = 5's ring by default: tests, sanitizers, A/B (~9 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ring-h100  # (the H100) k = 5's ring against two stages (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ring-k4  # k = 4's ring variant A/B; the ring's depth on k = 5 (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k4-ring-check  # k = 4's ring by default: GPU tests, memcheck, racecheck (~7 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k4-ring-ncu    # ncu's stall samples at M = 1 with and without it (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh ring8      # k = 4's ring of 8 at 3..8 rows; k = 5's ring at 8 stages (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k3-wide-ring  # k = 3 on 8 warps with and without the ring; its GPU test (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh compact-ring  # compact stages of A in the rings; k = 2's ring (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh rows-ab    # k = 4's ring at 3..4 rows, k = 5's 8 stages, k = 3's
#       8 warps from 3 rows as taken, against the rules before; memcheck of the rings (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh rows-check # their GPU tests (~7 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k4-ring-rows-more # k = 4's ring at 5..8 rows on more layers
#       of few row tiles (14336x4096 gained 5% there, the wide layers lost 1-1.7%), fp16 and bf16 (~6 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k5-m16-ncu # stall samples of k = 5's 16-warp launch at 8 and 16
#       rows (one and two n8 tiles: 8-10% slower at two) on 8192x57344 (~3 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k3-byte-lanes # k = 3's tiles in byte lanes (KBIT_K3_BYTE_LANES),
#       also with the scale after (KBIT_SCALE_AFTER_K3): SASS of the loops, GPU tests (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh k3-byte-lanes-ab # their A/B, fp16 and bf16 (~7 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh memcheck   # (~8 min)
#   KBIT_COMMIT=<commit> bash benchmarks/knob_first_run.sh racecheck  # (~9 min)
# Each step warms the kernel cache it needs first (the machine keeps it while
# it stays warm; a fresh one starts empty). Where a knob wins, its default
# changes and the usual proof follows (the GPU tests and sanitizers without the
# knob, full_sweep.py).
set -u
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
commit=${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}
out=${OUT:-/tmp}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$gpu" in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
echo "$gpu  commit $commit"
KSPLIT2=KBIT_LATENCY_KSPLIT=2,_jit.GEMM_LATENCY_KSPLIT=2
KSPLIT4=KBIT_LATENCY_KSPLIT=4,_jit.GEMM_LATENCY_KSPLIT=4
K5_OFF=_jit.GEMM_WG_K5_FULL_ROWS=0
FOLD=KBIT_CB_FOLD=1
BASE_OFF=KBIT_TAB_UNIFORM_BASE=0
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)  # (the ncu steps)

# run LIMIT FILE CMD...: CMD under a time limit, its output to $out/FILE (and the
# last lines here); a step cut off by its limit says so in its file
run() {
  local limit=$1 file=$out/$2; shift 2
  timeout "$limit" "$@" > "$file" 2>&1
  local rc=$?
  [ "$rc" = 124 ] && echo "TIMED OUT after $limit s: no complete result" >> "$file"
  echo "== $(basename "$file") (rc $rc)"; tail -n 6 "$file"
  return "$rc"
}
# ncu_source NAME DEFINE ARGS...: ncu's per-instruction stall samples of the
# one gemm_mma launch of profile_gemm.py ARGS (--define=DEFINE if given), as
# $out/NAME.csv.gz and its summary
ncu_source() {
  local name=$1 d=$2; shift 2
  run 150 $name.txt "$NCU" --clock-control none --kernel-name regex:kbit_gemm_mma --launch-count 1 \
    --section SourceCounters --section WarpStateStats -f -o "/tmp/$name" \
    python benchmarks/profile_gemm.py "$@" ${d:+--define=$d}
  "$NCU" --import "/tmp/$name.ncu-rep" --page source --csv 2>&1 | gzip > "$out/$name.csv.gz"
  run 30 ${name}_summary.txt python benchmarks/ncu_source_summary.py "$out/$name.csv.gz"
}
# warm [DEFINE] FAMILY...: the kernel cache, with -DDEFINE if given (a marker
# file skips a warm this machine has done for this commit: a step run again
# after a kernel change on the same machine found the old marker and compiled
# its kernels inside its tests, past their time limit)
warm() {
  local define=$1; shift
  local label=${commit}_${define:-default}_$*
  label=${label//[^A-Za-z0-9]/_}
  [ -e "/tmp/kbit_warm_$label" ] && return
  local defs=() d  # (a comma-separated DEFINE: one --define each)
  for d in ${define//,/ }; do defs+=(--define "$d"); done
  run 150 warm_${tag}_${label}.txt python benchmarks/warm_kernel_cache.py --families "$@" -j 16 \
    "${defs[@]}" && touch "/tmp/kbit_warm_$label"
}

case "${1:-}" in
  ab-ksplit)
    warm "" gemm_latency
    warm KBIT_LATENCY_KSPLIT=2 gemm_latency
    warm KBIT_LATENCY_KSPLIT=4 gemm_latency
    run 280 define_ab_${tag}_ksplit_${commit}.txt python benchmarks/define_ab.py \
      --define "$KSPLIT2" --define "$KSPLIT4" --layers 768x2048 2048x768 2048x512 4096x4096 \
      4096x6144 --m 1 4 16 --k 2 3 4 5 --kernel latency
    for d in "$KSPLIT2" "$KSPLIT4"; do
      run 80 moe_gap_probe_${tag}_ksplit${d:20:1}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts 128 --top-k 8 --shape 2048x1536 --t 1 2 --ab "$d"
    done ;;
  ab-k5)
    warm "" gemm_mma
    run 250 define_ab_${tag}_k5_192_rows_${commit}.txt python benchmarks/define_ab.py --define "$K5_OFF" \
      --layers 4096x28672 14336x4096 8192x57344 28672x8192 --m 200 256 512 1024 2048 --k 5 \
      --kernel wgmma auto ;;
  k5-mid)  # k = 5 on mid layers past 256 rows, now that its chunks are 256 rows (NOTES: "Next")
    warm "" gemm_mma
    run 400 k5_mid_${tag}_${commit}_float16.log python benchmarks/full_sweep.py --layers 4096x6144 \
      4096x4096 5120x5120 6144x4096 --m 384 512 1024 2048 4096 --k 5 --kernels auto wgmma dequant \
      --no-events --out "$out/k5_mid_${tag}_${commit}_float16" ;;
  ab-fold)  # k = 4's large-layer launch scales after the multiply: untouched there
    warm "" gemm_mma gemm_latency
    warm "$FOLD" gemm_mma gemm_latency
    run 260 define_ab_${tag}_cb_fold_${commit}.txt python benchmarks/define_ab.py --define "$FOLD" \
      --layers 4096x28672 14336x4096 8192x57344 28672x8192 --m 1 4 8 16 --k 2 3 4 5
    run 120 define_ab_${tag}_cb_fold_small_${commit}.txt python benchmarks/define_ab.py \
      --define "$FOLD" --layers 768x2048 2048x768 4096x4096 --m 1 4 16 --k 2 3 4 5 ;;
  check)
    warm "" gemm_mma gemm_latency moe_route
    warm KBIT_LATENCY_KSPLIT=2 gemm_latency
    warm KBIT_LATENCY_KSPLIT=4 gemm_latency
    warm "$FOLD" gemm_mma gemm_latency
    run 300 gpu_tests_knobs_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      tests/test_experts.py -k "half_k_tiles or k5_full or slab_chunks or codebook_fold" ;;
  fold-check)
    warm "" gemm_mma gemm_latency
    warm "$FOLD" gemm_mma gemm_latency
    run 200 gpu_tests_fold_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      tests/test_experts.py -k codebook_fold ;;
  chosen-ab)  # (cb85cba: gemm._cb_fold and experts._MOE_LATENCY_KSPLIT, measured on the H200 only)
    warm "" gemm_mma gemm_latency moe_route
    run 120 gpu_tests_fold_chosen_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k codebook_fold_chosen
    fold=_jit.GEMM_CB_FOLD=0
    [ "$tag" = h200 ] || fold=gemm._CB_FOLD_MIN_TBPS=0  # default: no fold below 4 TB/s
    run 200 define_ab_${tag}_cb_fold_chosen_${commit}.txt python benchmarks/define_ab.py --define "$fold" \
      --layers 4096x28672 14336x4096 8192x57344 28672x8192 --m 1 4 8 16 --k 2 5
    half=experts._MOE_LATENCY_KSPLIT=1
    [ "$tag" = h200 ] || half=experts._MOE_LATENCY_KSPLIT_MIN_TBPS=0  # default: whole tiles there
    for cfg in "128 8 2048x1536" "128 8 768x2048" "512 10 2048x512"; do
      set -- $cfg
      run 60 moe_gap_probe_${tag}_ksplit_ab_${1}e_${3}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$1" --top-k "$2" --shape "$3" --t 1 2 --ab "$half"
    done ;;
  ab-base)  # (mma_common.cuh tab_base; the k = 2, 4, 5 table launches of gemm_mma)
    warm "" gemm_mma gemm_latency moe_route
    warm "$BASE_OFF" gemm_mma
    run 290 define_ab_${tag}_tab_base_${commit}.txt python benchmarks/define_ab.py --define "$BASE_OFF" \
      --layers 4096x28672 14336x4096 8192x57344 28672x8192 --m 1 4 8 16 --k 2 3 4 5
    run 110 define_ab_${tag}_tab_base_small_${commit}.txt python benchmarks/define_ab.py \
      --define "$BASE_OFF" --layers 768x2048 4096x4096 4096x6144 --m 1 16 32 --k 2 3 4 5
    run 70 moe_gap_probe_${tag}_tab_base_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 2048x1536 --t 8 32 128 --ab "$BASE_OFF" ;;
  base-check)
    warm "" gemm_mma gemm_latency moe_route
    run 400 gpu_tests_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py tests/test_gpu.py \
      tests/test_gpu_callpath.py
    run 150 sanitize_tab_base_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python -m pytest -q tests/test_gpu_gemm.py -k "eight_warp_mma_launch or sixteen_warp_k5_launch" ;;
  base-rest)
    warm "" gemm_mma gemm_latency moe_route
    run 200 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py
    run 330 issue25_${tag}_${commit}_float16.log python benchmarks/full_sweep.py --layers 4096x28672 \
      14336x4096 8192x57344 28672x8192 --m 1 4 8 16 --k 2 3 4 5 --out "$out/issue25_${tag}_${commit}_float16" ;;
  ksplit-ab)  # (gemm._dense_latency_ksplit; measured on the H200 only) and the compile-test diagnosis
    warm "" gemm_latency gemm_mma
    run 60 compile_diag_${tag}_${commit}.txt bash -c 'for t in 2 6 8 16; do
        w=$(python -c "from kbit_cupy import _jit; print(_jit.gemm_grouped_wg_warpgroups($t, 4))")
        python benchmarks/compile_diag.py gemm_mma 4 float16 uint8 $t 1 $w True; done
      python -m pytest -q tests/test_experts.py -k adds_its_shared_memory'
    ksplit=gemm._DENSE_LATENCY_KSPLIT=1
    [ "$tag" = h200 ] || ksplit=gemm._DENSE_LATENCY_KSPLIT_MIN_TBPS=0  # default: whole tiles there
    run 200 define_ab_${tag}_dense_ksplit_${commit}.txt python benchmarks/define_ab.py --define "$ksplit" \
      --layers 768x2048 1024x4096 2048x768 4096x4096 --m 1 4 16 --k 2 3 4 5
    run 80 define_ab_${tag}_dense_ksplit_bf16_${commit}.txt python benchmarks/define_ab.py \
      --define "$ksplit" --layers 768x2048 1024x4096 --m 1 4 16 --k 2 4 --dtype bfloat16 ;;
  moe-ncu)  # ncu of the grouped launch where issue 21 misses (T = 128, 512)
    warm "" gemm_latency gemm_mma
    for c in e128_top8_768x2048:512 e128_top8_768x2048:128 e128_top8_2048x1536:128; do
      run 150 ncu_moe_${c%%:*}_T${c##*:}_${tag}_${commit}.txt "$NCU" --clock-control none \
        --kernel-name regex:kbit_gemm_mma --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section Occupancy \
        --section ComputeWorkloadAnalysis --section LaunchStats --section WarpStateStats \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        python benchmarks/profile_moe.py "${c%%:*}" "${c##*:}"
    done ;;
  moe-knobs)  # the grouped launch's warpgroups and path where issue 21 misses (T = 8..512)
    warm "" gemm_latency gemm_mma
    for c in 768x2048:128:512:experts._GROUPED_WG_WARPGROUPS=3 768x2048:128:512:experts._GROUPED_WG_WARPGROUPS=2 \
             2048x1536:128:128:experts._GROUPED_WG_WARPGROUPS=2; do
      IFS=: read -r shape t1 t2 knob <<< "$c"
      run 110 moe_gap_probe_${tag}_${shape}_${knob//[^A-Za-z0-9]/_}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts 128 --top-k 8 --shape "$shape" --t $t1 $t2 --ab "$knob"
    done
    run 80 moe_gap_probe_${tag}_768x2048_wg_ab_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 768x2048 --t 128 --wg-ab
    run 80 moe_gap_probe_${tag}_e512_wg_ab_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 512 --top-k 10 --shape 2048x512 --t 8 32 --wg-ab ;;
  wg-desc)  # the wgmma descriptors in a uniform register (KBIT_WG_DESC_UNIFORM=0: as before) against the default
    warm "" gemm_mma
    warm KBIT_WG_DESC_UNIFORM=0 gemm_mma
    for c in 128:2048x1536:128,512 128:768x2048:128,512 512:2048x512:32,128; do
      IFS=: read -r e shape ts <<< "$c"
      run 150 moe_gap_probe_${tag}_wg_desc_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k $([ "$e" = 512 ] && echo 10 || echo 8) --shape "$shape" --t ${ts//,/ } \
        --ab KBIT_WG_DESC_UNIFORM=0
    done
    run 200 define_ab_${tag}_wg_desc_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_WG_DESC_UNIFORM=0 --layers 768x2048 4096x4096 14336x4096 \
      --m 32 64 128 --k 2 4 --kernel wgmma --reps 15 ;;
  quad-store)  # C in 8-byte pieces (KBIT_QUAD_STORE=0: 2-byte stores) and the next expert found from the current one (KBIT_LOCATE_HINT=0: binary search), each against the default
    warm "" gemm_mma
    for c in 128:768x2048:32,128,512 128:2048x1536:8,128,512 512:2048x512:32,128 8:4096x28672:128,512; do
      IFS=: read -r e shape ts <<< "$c"
      topk=$([ "$e" = 512 ] && echo 10 || { [ "$e" = 8 ] && echo 2 || echo 8; })
      for d in KBIT_QUAD_STORE=0 KBIT_LOCATE_HINT=0; do
        run 120 moe_gap_probe_${tag}_${d%%=*}_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
          --experts "$e" --top-k "$topk" --shape "$shape" --t ${ts//,/ } --ab "$d"
      done
    done ;;
  quad-store-gate)  # the 8-byte stores only in problems filled past a quarter: the few-row configs again
    warm "" gemm_mma
    for c in 128:768x2048:8,32,512 512:2048x512:32,128; do
      IFS=: read -r e shape ts <<< "$c"
      run 120 moe_gap_probe_${tag}_quad_gate_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k $([ "$e" = 512 ] && echo 10 || echo 8) --shape "$shape" --t ${ts//,/ } \
        --ab KBIT_QUAD_STORE=0
    done ;;
  grouped-fold)  # the scale pair's factor folded into the grouped launch's tables (KBIT_CB_FOLD=1, every variant) and the row lookups of all n8 tiles at once (KBIT_CROW_CHUNK=8), each against the default
    warm "" gemm_mma
    for c in 128:2048x1536:128,512 128:768x2048:128,512 8:4096x28672:128; do
      IFS=: read -r e shape ts <<< "$c"
      for d in KBIT_CB_FOLD=1 KBIT_CROW_CHUNK=8; do
        run 120 moe_gap_probe_${tag}_${d%%=*}_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
          --experts "$e" --top-k $([ "$e" = 8 ] && echo 2 || echo 8) --shape "$shape" --t ${ts//,/ } --ab "$d"
      done
    done ;;
  route-batch)  # moe_linear's fused routing: the router's ids loaded 8 at a time (default) against one after another (KBIT_ROUTE_ID_BATCH=1)
    warm "" gemm_mma
    for c in 128:768x2048:128,512 128:2048x1536:128,512 512:2048x512:8,32,128,512 8:4096x28672:128,512; do
      IFS=: read -r e shape ts <<< "$c"
      topk=$([ "$e" = 512 ] && echo 10 || { [ "$e" = 8 ] && echo 2 || echo 8; })
      run 120 moe_gap_probe_${tag}_route_batch_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k "$topk" --shape "$shape" --t ${ts//,/ } --ab KBIT_ROUTE_ID_BATCH=1
    done ;;
  route-batch-check)  # test_experts (the routing, moe_linear, the few-row bound); the latency-cap step's Qwen3-235B line
    warm "" gemm_mma gemm_latency moe_route
    run 330 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py
    run 100 moe_gap_probe_${tag}_latency_cap_qwen_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 4096x3072 --t 1 \
      --ab experts._LATENCY_MOE_MAX_CTAS=1536,experts._LATENCY_MOE_FAST_MAX_WEIGHTS=16777216 ;;
  route-cap)  # moe_linear's in-launch routing past 4096 pairs (experts._FUSED_ROUTE_MAX_PAIRS=8192) against the routing launch; memcheck of the routed paths
    warm "" gemm_mma moe_route
    for c in 512:2048x512:512,800 128:768x2048:1024 128:2048x1536:1024; do
      IFS=: read -r e shape ts <<< "$c"
      topk=$([ "$e" = 512 ] && echo 10 || echo 8)
      run 120 moe_gap_probe_${tag}_route_cap_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k "$topk" --shape "$shape" --t ${ts//,/ } --ab experts._FUSED_ROUTE_MAX_PAIRS=8192
    done
    run 150 sanitize_moe_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --k 2 4
    run 150 sanitize_moe_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 4 ;;
  route-slice)  # moe_linear's in-launch placement: odd slices of the ids a thread (default) against even ones (KBIT_ROUTE_SLICE_ODD=0); issue 21's table
    warm "" gemm_mma gemm_latency moe_route
    for c in 128:768x2048:128,512 128:2048x1536:128,512; do
      IFS=: read -r e shape ts <<< "$c"
      run 120 moe_gap_probe_${tag}_route_slice_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k 8 --shape "$shape" --t ${ts//,/ } --ab KBIT_ROUTE_SLICE_ODD=0
    done
    run 260 moe_vs_grouped_mm_${tag}_${commit}.txt python benchmarks/moe_vs_grouped_mm.py --t 1 8 32 128 512 \
      --out "$out/moe_vs_grouped_mm_${tag}_${commit}" ;;
  route-check)  # test_experts and memcheck of the routed paths with both routing changes; moe_linear's few-pair cases: the placement before the prefetch, the routing launch
    warm "" gemm_mma gemm_latency moe_route
    run 330 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py
    run 150 sanitize_moe_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --k 2 4
    run 150 sanitize_moe_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 4
    for d in KBIT_ROUTED_PREFETCH=0 experts._FUSED_ROUTE_MAX_PAIRS=0; do
      run 90 moe_gap_probe_${tag}_$(d=${d%%=*}; echo ${d##*.})_512_2048x512_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts 512 --top-k 10 --shape 2048x512 --t 8 32 --ab "$d"
    done ;;
  moe-phases)  # stamps of the grouped launch's set-up (ids in, scanned, placed), moe_linear against kbit_grouped_gemm
    warm "" gemm_mma gemm_latency moe_route
    run 200 mma_phases_moe_${tag}_512e_${commit}.txt python benchmarks/mma_phases.py --moe 512,10 \
      --layers 2048x512 --m 8 32 128
    for shape in 2048x1536 768x2048; do
      run 200 mma_phases_moe_${tag}_128e_${shape}_${commit}.txt python benchmarks/mma_phases.py --moe 128,8 \
        --layers "$shape" --m 8 128 512
    done ;;
  moe-phases2)  # the placement's own stamps (11 placing, 12 first scan), with and without the first tile's prefetch
    warm "" gemm_mma
    for d in "" "--define KBIT_ROUTED_PREFETCH=0"; do
      sfx=$([ -n "$d" ] && echo _noprefetch || echo "")
      run 150 mma_phases_moe2_${tag}_512e${sfx}_${commit}.txt python benchmarks/mma_phases.py --moe 512,10 \
        --layers 2048x512 --m 8 128 $d
      run 150 mma_phases_moe2_${tag}_128e_2048x1536${sfx}_${commit}.txt python benchmarks/mma_phases.py --moe 128,8 \
        --layers 2048x1536 --m 128 512 $d
    done ;;
  moe-early-tile)  # moe_linear: the first weight tile loaded into registers before the placement (inlined), A/B and stamps (run at ded69f3 as =1 against that tree's default 0; since b7abdb7 the default is 2, so =1 differs from it only on the mma.sync and past-4-tile grouped variants)
    warm "" gemm_mma
    for c in 512:2048x512:8,32,128:10 128:2048x1536:8,128,512:8 128:768x2048:8,128,512:8; do
      IFS=: read -r e shape ts topk <<< "$c"
      run 120 moe_gap_probe_${tag}_early_tile_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k "$topk" --shape "$shape" --t ${ts//,/ } --ab KBIT_ROUTED_EARLY_TILE=1
    done
    run 100 mma_phases_moe_${tag}_early_tile_512e_${commit}.txt python benchmarks/mma_phases.py --moe 512,10 \
      --layers 2048x512 --m 8 --define KBIT_ROUTED_EARLY_TILE=1
    run 100 mma_phases_moe_${tag}_early_tile_128e_2048x1536_${commit}.txt python benchmarks/mma_phases.py --moe 128,8 \
      --layers 2048x1536 --m 128 --define KBIT_ROUTED_EARLY_TILE=1 ;;
  early-tile-check)  # the first weight tile before the placement by default (Hopper path): test_experts, memcheck and racecheck of the grouped wgmma launch, a Qwen3-235B A/B
    warm "" gemm_mma gemm_latency moe_route
    run 330 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py
    run 150 sanitize_moe_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 3 4 5
    run 150 sanitize_moe_wgmma_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 4
    run 100 moe_gap_probe_${tag}_early_tile_off_qwen_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 4096x3072 --t 128 512 --ab KBIT_ROUTED_EARLY_TILE=0 ;;
  early-tile-k)  # the first weight tile before the placement at k = 2, 3, 5 (the A/B ran at k = 4), fp16 and bf16, against KBIT_ROUTED_EARLY_TILE=0
    warm "" gemm_mma
    for k in 2 3 5; do
      run 100 moe_gap_probe_${tag}_early_tile_off_k${k}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --k "$k" --shape 2048x1536 --t 128 512 --ab KBIT_ROUTED_EARLY_TILE=0
    done
    run 100 moe_gap_probe_${tag}_early_tile_off_bf16_${commit}.txt python benchmarks/moe_gap_probe.py \
      --dtype bfloat16 --shape 768x2048 --t 128 512 --ab KBIT_ROUTED_EARLY_TILE=0 ;;
  warp-search)  # the grouped launch's expert lookups by warp ballots (default) against the binary search (KBIT_WARP_SEARCH=0); test_experts
    run 90 moe_gap_probe_${tag}_warp_search_off_512_2048x512_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 512 --top-k 10 --shape 2048x512 --t 8 32 --ab KBIT_WARP_SEARCH=0
    run 60 moe_gap_probe_${tag}_warp_search_off_128_2048x1536_${commit}.txt python benchmarks/moe_gap_probe.py \
      --shape 2048x1536 --t 128 --ab KBIT_WARP_SEARCH=0
    warm "" gemm_mma gemm_latency moe_route
    run 330 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py ;;
  warp-search-sanitize)  # memcheck and racecheck of the grouped launches with the warp search (mma.sync k = 2, 4, 5; wgmma k = 4), issue 21's table
    warm "" gemm_mma gemm_latency moe_route
    run 150 sanitize_moe_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --k 2 4 5
    run 150 sanitize_moe_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 4
    run 150 sanitize_moe_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_moe.py --quick --k 4
    run 260 moe_vs_grouped_mm_${tag}_${commit}.txt python benchmarks/moe_vs_grouped_mm.py --t 1 8 32 128 512 \
      --out "$out/moe_vs_grouped_mm_${tag}_${commit}" ;;
  moe-setup-ab)  # moe_linear's in-launch routing: the placement inlined (k = 4; at k = 5 two variants spill 12 bytes inlined) against the default
    warm "" gemm_mma
    for c in 512:2048x512:8,128:10 128:2048x1536:128:8 128:768x2048:128,512:8; do
      IFS=: read -r e shape ts topk <<< "$c"
      for d in KBIT_PLACE_INLINE=1; do  # (KBIT_ROUTE_ONE_SCAN, run at 3e1f602, is removed: results/experiment_route_one_scan_25b98fa.patch)
        run 100 moe_gap_probe_${tag}_${d%%=*}_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
          --experts "$e" --top-k "$topk" --shape "$shape" --t ${ts//,/ } --ab "$d"
      done
    done ;;
  latency-cap)  # the few-row launch's bound: 1024 against the default (1536 on a >= 4 TB/s GPU for experts of <= 2^22 weights); Qwen3-235B's gate_up with the bound at 1536 (run at 8436f3c: 1024 against 8192 and 2048)
    for c in 512:2048x512:4,5 128:2048x1536:2 128:768x2048:1,2; do
      IFS=: read -r e shape ts <<< "$c"
      run 100 moe_gap_probe_${tag}_latency_cap_${e}_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k $([ "$e" = 512 ] && echo 10 || echo 8) --shape "$shape" --t ${ts//,/ } \
        --ab experts._LATENCY_MOE_MAX_CTAS_FAST=1024
    done
    run 100 moe_gap_probe_${tag}_latency_cap_qwen_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 4096x3072 --t 1 \
      --ab experts._LATENCY_MOE_MAX_CTAS=1536,experts._LATENCY_MOE_FAST_MAX_WEIGHTS=16777216 ;;
  quad-store-dense)  # the dense launches' C stores in 8-byte pieces against 2-byte stores
    warm "" gemm_mma
    run 300 define_ab_${tag}_quad_store_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_QUAD_STORE=0 --layers 768x2048 2048x768 4096x4096 \
      --m 16 32 64 128 256 --k 2 4 --reps 15 ;;
  quad-store-check)  # GPU tests of the store paths, the grouped launch and the wgmma paths
    warm "" gemm_mma gemm_latency moe_route
    run 150 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py \
      -k "alignment or both_paths or hopper or matches or routing"
    run 300 gpu_tests_gemm_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "alignment or wgmma or small_sweep or wide_sweep or both_work_splits or eight_warp" ;;
  quad-store-sanitize)  # memcheck of the 8-byte stores (grouped Hopper path, dense mma and wgmma); the rest of test_gpu_gemm
    warm "" gemm_mma gemm_latency moe_route
    run 120 sanitize_moe_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 2 4
    run 100 sanitize_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --quick --only wgmma --k 2 4
    run 100 sanitize_mma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --quick --only mma --k 2 4
    run 150 gpu_tests_gemm_rest_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "not (alignment or wgmma or small_sweep or wide_sweep or both_work_splits or eight_warp)" ;;
  wg-desc-check)  # GPU tests of the wgmma paths and the MoE calls; moe_linear's in-launch routing at 4096 pairs
    warm "" gemm_mma gemm_latency moe_route
    run 260 gpu_tests_wgmma_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "wgmma or small_sweep or wide_sweep"
    run 200 gpu_tests_experts_${tag}_${commit}.txt python -m pytest -q tests/test_experts.py
    run 90 moe_gap_probe_${tag}_fused_route_2048_${commit}.txt python benchmarks/moe_gap_probe.py \
      --experts 128 --top-k 8 --shape 768x2048 --t 512 --ab experts._FUSED_ROUTE_MAX_PAIRS=2048 ;;
  moe-table)  # issue 21's table (moe_vs_grouped_mm, T = 1..512), the rest of test_gpu_gemm, the bound's A/B in bf16
    warm "" gemm_mma gemm_latency moe_route
    run 260 moe_vs_grouped_mm_${tag}_${commit}.txt python benchmarks/moe_vs_grouped_mm.py --t 1 8 32 128 512 \
      --out "$out/moe_vs_grouped_mm_${tag}_${commit}"
    run 200 gpu_tests_gemm_rest_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "not (wgmma or small_sweep or wide_sweep)"
    run 120 define_ab_${tag}_dense_ksplit_bound_bf16_${commit}.txt python benchmarks/define_ab.py \
      --define gemm._DENSE_LATENCY_KSPLIT=1 --layers 768x4096 1280x2048 1536x2048 --m 1 4 16 --k 2 4 \
      --reps 15 --dtype bfloat16 ;;
  wg-desc-sanitize)  # memcheck and racecheck of the wgmma launches (grouped and dense) with the uniform descriptors
    warm "" gemm_mma gemm_latency moe_route
    run 150 sanitize_moe_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 2 4 5
    run 120 sanitize_wgmma_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --quick --only wgmma --k 2 4
    run 150 sanitize_moe_wgmma_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_moe.py --quick --wgmma --k 4 ;;
  moe-quarter)  # the few-pair MoE launch at quarter K tiles (KSPLIT 4) against half (the default at k = 4 on the H200)
    warm "" gemm_latency
    for c in 128:8:2048x1536 128:8:768x2048; do
      IFS=: read -r e topk shape <<< "$c"
      run 100 moe_gap_probe_${tag}_quarter_${shape}_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts "$e" --top-k "$topk" --shape "$shape" --t 1 2 --ab experts._MOE_LATENCY_KSPLIT=4
    done ;;
  moe-ncu-source)  # per-instruction stall samples of the grouped Hopper launch (T = 512 and 128; no warm: one variant each)
    for c in e128_top8_768x2048:512 e128_top8_2048x1536:128; do
      name=ncu_source_moe_${c%%:*}_T${c##*:}_${tag}_${commit}
      run 100 $name.txt "$NCU" --clock-control none --kernel-name regex:kbit_gemm_mma --launch-skip 2 \
        --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "/tmp/$name" \
        python benchmarks/profile_moe.py "${c%%:*}" "${c##*:}"
      "$NCU" --import "/tmp/$name.ncu-rep" --page source --csv 2>&1 | gzip > "$out/$name.csv.gz"
      run 30 ${name}_summary.txt python benchmarks/ncu_source_summary.py "$out/$name.csv.gz"
    done ;;
  lut-check)  # the lookup kernel as shipped: its GPU tests, sanitizers, and the four large layers against the other fused kernels
    warm "" gemm_lut  # (the few mma and latency variants compile where first used)
    run 150 gpu_tests_lut_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py -k lut
    run 100 sanitize_lut_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --lut
    run 150 sanitize_lut_racecheck_${tag}_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_kernels.py --lut --quick
    for dt in float16 bfloat16; do
      run 150 lut_${tag}_${commit}_${dt}.txt python benchmarks/latency_kernel.py --layers 8192x57344 4096x28672 \
        14336x4096 28672x8192 --m 1 --k 2 --kernels mma latency lut auto --dtype $dt --out "$out/lut_${tag}_${commit}_${dt}"
    done ;;
  lut-ncu)  # where gemm_lut.cu's time goes (cold L2: ncu flushes the caches before the launch)
    warm "" gemm_lut
    name=ncu_lut_8192x57344_k2_M1_${tag}_${commit}
    run 120 $name.txt "$NCU" --clock-control none --kernel-name regex:kbit_gemm_lut --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
      python benchmarks/profile_gemm.py 8192 57344 1 2 lut
    name=ncu_source_lut_8192x57344_k2_M1_${tag}_${commit}
    run 120 $name.txt "$NCU" --clock-control none --kernel-name regex:kbit_gemm_lut --launch-count 1 \
      --section SourceCounters --section WarpStateStats -f -o "/tmp/$name" \
      python benchmarks/profile_gemm.py 8192 57344 1 2 lut
    "$NCU" --import "/tmp/$name.ncu-rep" --page source --csv 2>&1 | gzip > "$out/$name.csv.gz"
    run 30 ${name}_summary.txt python benchmarks/ncu_source_summary.py "$out/$name.csv.gz" ;;
  moe-ncu-setup)  # per-instruction stall samples of the mma.sync grouped launch at 512 experts T = 8: moe_linear (its set-up) and kbit_grouped_gemm
    for m in moe grouped; do
      name=ncu_source_${m}_e512_top10_2048x512_T8_${tag}_${commit}
      run 120 $name.txt "$NCU" --clock-control none --kernel-name regex:kbit_gemm_mma --launch-skip 2 \
        --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "/tmp/$name" \
        python benchmarks/profile_moe.py e512_top10_2048x512 8 $([ "$m" = moe ] && echo --moe-linear)
      "$NCU" --import "/tmp/$name.ncu-rep" --page source --csv 2>&1 | gzip > "$out/$name.csv.gz"
      run 30 ${name}_summary.txt python benchmarks/ncu_source_summary.py "$out/$name.csv.gz"
    done ;;
  ksplit-bound)  # the rule's bound (raised to 8 here): layers of 2 and 5-6 warps an SM (run at d98d75e: the bound is 6)
    warm "" gemm_latency
    bound=gemm._DENSE_LATENCY_KSPLIT_MAX_SM_WARPS=8
    [ "$tag" = h200 ] || bound=$bound,gemm._DENSE_LATENCY_KSPLIT_MIN_TBPS=0
    run 200 define_ab_${tag}_dense_ksplit_bound_${commit}.txt python benchmarks/define_ab.py \
      --define gemm._DENSE_LATENCY_KSPLIT=1 --define "$bound" \
      --layers 512x2048 768x4096 1280x2048 1536x2048 --m 1 4 16 --k 2 4 --reps 15 ;;
  ksplit-check)
    warm "" gemm_latency gemm_mma
    run 150 gpu_tests_dense_ksplit_${tag}_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "dense_latency_half_k_tiles or (small_sweep and latency)"
    run 100 sanitize_dense_ksplit_memcheck_${tag}_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_kernels.py --quick --only latency --k 2 4 \
      --define gemm._DENSE_LATENCY_KSPLIT_MIN_TBPS=0 ;;
  memcheck|racecheck)
    tool=$1 quick=$([ "$1" = racecheck ] && echo --quick)
    for d in "$KSPLIT2" "$KSPLIT4"; do
      n=ksplit${d:20:1}
      run 100 sanitize_${n}_${tool}_${tag}_${commit}.txt compute-sanitizer --tool "$tool" \
        python benchmarks/sanitize_kernels.py $quick --only latency --define "$d"
      run 80 sanitize_moe_${n}_${tool}_${tag}_${commit}.txt compute-sanitizer --tool "$tool" \
        python benchmarks/sanitize_moe.py --quick --define "$d"
    done
    run 120 sanitize_k5_${tool}_${tag}_${commit}.txt compute-sanitizer --tool "$tool" \
      python benchmarks/sanitize_kernels.py $quick --large-m --k 5
    run 120 sanitize_fold_${tool}_${tag}_${commit}.txt compute-sanitizer --tool "$tool" \
      python benchmarks/sanitize_kernels.py --quick --k 2 3 --define "$FOLD" ;;
  copy-warps-h100)  # (the H100) A copied by four warps at 5..16 rows against every warp; the lone-CTA charge (gated to 4 TB/s) with the gate lowered
    warm "" gemm_mma gemm_latency gemm_lut
    run 200 define_ab_${tag}_a_copy_warps_off_${commit}_float16.txt python benchmarks/define_ab.py \
      --define KBIT_A_COPY_WARPS=0 --layers 8192x57344 28672x8192 4096x28672 14336x4096 --m 6 8 12 16 --k 2 4 5
    run 200 define_ab_${tag}_underfill_gate_${commit}.txt python benchmarks/define_ab.py \
      --define gemm._FAST_TBPS=3 --layers 11008x4096 13824x8192 22016x8192 18944x4096 29568x4096 \
      --m 1 4 8 --k 4 2 --kernel mma ;;
  copy-warps-ncu)  # per-instruction stall samples of the 8-warp mma launch at 8 rows (k = 4): four copying warps and every warp
    for d in "" KBIT_A_COPY_WARPS=0; do
      ncu_source ncu_source_mma8_8192x57344_M8_k4_${d:+copy_all_}${tag}_${commit} "$d" 8192 57344 8 4 mma
    done ;;
  no-bar-probe)  # (a probe, wrong results) the dense mma.sync launches without their per-tile barrier: what the barrier's wait costs
    warm "" gemm_mma
    warm KBIT_PROBE_NO_BAR=1 gemm_mma
    run 280 define_ab_${tag}_probe_no_bar_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_PROBE_NO_BAR=1 --layers 8192x57344 28672x8192 4096x28672 14336x4096 --m 1 8 16 --k 2 4 --kernel mma ;;
  a-ring)  # A's stages in a ring of 3 or 4 handed over by mbarriers (KBIT_A_RING) against two stages and a barrier a K tile; its accuracy over odd shapes
    warm "" gemm_mma
    warm KBIT_A_RING=4 gemm_mma
    warm KBIT_A_RING=3 gemm_mma
    run 150 define_check_${tag}_a_ring_${commit}.txt python benchmarks/define_check.py \
      --define KBIT_A_RING=4,_jit.GEMM_MMA_A_RING=4 --define KBIT_A_RING=3,_jit.GEMM_MMA_A_RING=3
    run 330 define_ab_${tag}_a_ring_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_A_RING=3,_jit.GEMM_MMA_A_RING=3 --define KBIT_A_RING=4,_jit.GEMM_MMA_A_RING=4 \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 4 8 16 --k 2 4 5 --kernel mma ;;
  a-ring-auto)  # the ring as a user meets it (kernel auto), k = 2..5, large and mid layers
    warm "" gemm_mma gemm_latency gemm_lut
    warm KBIT_A_RING=4 gemm_mma gemm_latency gemm_lut
    warm KBIT_A_RING=3 gemm_mma gemm_latency gemm_lut
    run 400 define_ab_${tag}_a_ring_auto_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_A_RING=3,_jit.GEMM_MMA_A_RING=3 --define KBIT_A_RING=4,_jit.GEMM_MMA_A_RING=4 \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 4096x4096 --m 1 2 4 8 12 16 --k 2 3 4 5 --kernel auto ;;
  ring-check)  # the ring as the default of k = 5's 16-warp launch: its GPU tests, memcheck and racecheck, an A/B against two stages
    warm "" gemm_mma gemm_latency gemm_lut
    warm KBIT_A_RING=0 gemm_mma
    run 240 gpu_tests_${tag}_a_ring_${commit}.txt python -m pytest -q -x tests/test_gpu_gemm.py \
      -k "a_ring or sixteen_warp or four_warps"
    run 150 sanitize_wide_mma_memcheck_${tag}_a_ring_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_wide_mma.py --k5
    run 150 sanitize_wide_mma_racecheck_${tag}_a_ring_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_wide_mma.py --k5 --quick
    for dt in float16 bfloat16; do
      run 150 define_ab_${tag}_a_ring_off_${commit}_${dt}.txt python benchmarks/define_ab.py \
        --define KBIT_A_RING=0,_jit.GEMM_MMA_A_RING=0 --dtype $dt \
        --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 4096x4096 --m 1 4 8 16 --k 5
    done ;;
  k4-ring-check)  # (run at b172fa5) k = 4's ring at 1..2 rows by default: its GPU tests, memcheck, racecheck of the rest
    warm "" gemm_mma gemm_latency gemm_lut
    run 200 gpu_tests_${tag}_k4_ring_${commit}.txt python -m pytest -q -x tests/test_gpu_gemm.py \
      -k "a_ring or sixteen_warp or four_warps or eight_warp or lone_ctas"
    run 120 sanitize_wide_mma_memcheck_${tag}_ring_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_wide_mma.py --ring
    # (racecheck reports every mbarrier-ordered refill of a ring's stage as a
    # WAR hazard, racecheck_mbarrier_probe.py: it checks the launches without
    # refills, --quick without --ring)
    run 240 sanitize_wide_mma_racecheck_${tag}_ring_${commit}.txt compute-sanitizer --tool racecheck \
      python benchmarks/sanitize_wide_mma.py --quick ;;
  k4-ring-ncu)  # per-instruction stall samples of k = 4's 8-warp launch at M = 1: the ring (the default) and two stages
    for d in "" gemm._K4_RING_MAX_M=0; do
      ncu_source ncu_source_mma8_8192x57344_M1_k4_${d:+two_stage_}${tag}_${commit} "$d" 8192 57344 1 4 mma
    done ;;
  ring8)  # k = 4's ring of 8 at up to 4 and 8 rows (gemm._K4_RING_MAX_M, 2); k = 5's ring of 8 stages (KBIT_A_RING=8) against its 4
    warm "" gemm_mma gemm_latency gemm_lut
    for dt in float16 bfloat16; do
      run 150 define_ab_${tag}_k4_ring8_rows_${commit}_${dt}.txt python benchmarks/define_ab.py \
        --define gemm._K4_RING_MAX_M=4 --define gemm._K4_RING_MAX_M=8 --dtype $dt \
        --layers 8192x57344 28672x8192 4096x28672 14336x4096 --m 3 4 6 8 --k 4
    done
    warm KBIT_A_RING=8 gemm_mma
    run 200 define_ab_${tag}_k5_ring8_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_A_RING=8,_jit.GEMM_MMA_A_RING=8 \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 4 8 12 16 --k 5 ;;
  k3-wide-ring)  # k = 3 on 8 warps (gemm._K3_WIDE) with the ring of 8 at 1..2 rows, and without it, against 4 warps; its GPU test
    warm "" gemm_mma gemm_latency gemm_lut
    run 200 gpu_tests_${tag}_k3_ring_${commit}.txt python -m pytest -q -x tests/test_gpu_gemm.py -k "a_ring"
    for dt in float16 bfloat16; do
      run 150 define_ab_${tag}_k3_wide_ring_${commit}_${dt}.txt python benchmarks/define_ab.py \
        --define gemm._K3_WIDE=1 --define gemm._K3_WIDE=1,gemm._K3_RING_MAX_M=0 --dtype $dt \
        --layers 8192x57344 28672x8192 4096x28672 14336x4096 --m 1 2 4 --k 3
    done ;;
  compact-ring)  # compact stages (KBIT_A_COMPACT: 2 rows of A a stage in the RING variants): k = 3/4's rings against full stages; k = 2's ring (gemm._K2_RING_MAX_M) with full and compact stages; the GPU test
    warm "" gemm_mma gemm_latency gemm_lut
    warm KBIT_A_COMPACT=1 gemm_mma
    C=KBIT_A_COMPACT=1,_jit.GEMM_MMA_A_COMPACT=1
    run 240 gpu_tests_${tag}_compact_ring_${commit}.txt python -m pytest -q -x tests/test_gpu_gemm.py -k "compact_ring"
    run 150 define_ab_${tag}_compact_ring_k4_${commit}.txt python benchmarks/define_ab.py --define $C \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 --m 1 2 --k 4
    for kern in auto mma; do
      run 150 define_ab_${tag}_k2_ring_${kern}_${commit}.txt python benchmarks/define_ab.py --kernel $kern \
        --define gemm._K2_RING_MAX_M=2 --define $C,gemm._K2_RING_MAX_M=2 \
        --layers 8192x57344 28672x8192 14336x4096 --m 1 2 --k 2
    done
    run 120 sanitize_wide_mma_memcheck_${tag}_compact_ring_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_wide_mma.py --ring --define=$C,gemm._K2_RING_MAX_M=2 ;;
  k4-ring-rows-more)  # k = 4's ring at up to 8 rows (gemm._K4_RING_MAX_M=8) against up to 4, at 5..8 rows, on layers of 28..64 groups of row tiles and the wide ones
    warm "" gemm_mma gemm_latency gemm_lut
    for dt in float16 bfloat16; do
      run 200 define_ab_${tag}_k4_ring_rows_more_${commit}_${dt}.txt python benchmarks/define_ab.py \
        --define gemm._K4_RING_MAX_M=8 --dtype $dt \
        --layers 14336x4096 13824x5120 18944x3584 28672x8192 8192x28672 8192x57344 --m 5 6 8 --k 4
    done ;;
  k5-m16-ncu)  # per-instruction stall samples of k = 5's 16-warp launch at one n8 tile (M = 8) and two (M = 16)
    for m in 8 16; do
      ncu_source ncu_source_mma16_8192x57344_M${m}_k5_${tag}_${commit} "" 8192 57344 $m 5 mma
    done ;;
  k3-byte-lanes)  # k = 3's tiles in byte lanes (KBIT_K3_BYTE_LANES=1 with _jit.GEMM_K3_BYTE_LANES=1: one PRMT a pair), also with the scale after the multiply (KBIT_SCALE_AFTER_K3): SASS of the loops, GPU tests
    run 180 sass_loop_${tag}_k3_byte_lanes_${commit}.txt python benchmarks/sass_loop.py \
      3:float16:uint8:1:1 3:float16:uint8:1:1:0:false:8 3:float16:uint8:8:1:4 --define KBIT_K3_BYTE_LANES=1 \
      --define KBIT_SCALE_AFTER_K3=1
    warm "" gemm_mma gemm_latency gemm_lut
    warm KBIT_K3_BYTE_LANES=1 gemm_mma gemm_latency
    warm KBIT_K3_BYTE_LANES=1,KBIT_SCALE_AFTER_K3=1 gemm_mma
    run 300 gpu_tests_${tag}_k3_byte_lanes_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py -k "k3_byte_lanes or k3_scale_after" ;;
  k3-byte-lanes-ab)  # their A/B: byte lanes, and byte lanes with the scale after, against the plain layout, fp16 and bf16
    L=KBIT_K3_BYTE_LANES=1,_jit.GEMM_K3_BYTE_LANES=1
    warm "" gemm_mma gemm_latency gemm_lut
    warm KBIT_K3_BYTE_LANES=1 gemm_mma gemm_latency
    warm KBIT_K3_BYTE_LANES=1,KBIT_SCALE_AFTER_K3=1 gemm_mma
    for dt in float16 bfloat16; do
      run 200 define_ab_${tag}_k3_byte_lanes_${commit}_${dt}.txt python benchmarks/define_ab.py --define $L \
        --define $L,KBIT_SCALE_AFTER_K3=1 --dtype $dt \
        --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 4 8 16 64 --k 3
    done ;;
  rows-ab)  # (run at 50eb206, k = 5's 8 stages then on, since off) as taken: k = 4's ring at up to 4 rows, k = 5's ring variant (8 stages) at up to 8, k = 3's 8 warps from 3 rows, against the rules before (2, none, never); memcheck of the rings
    warm "" gemm_mma gemm_latency gemm_lut
    run 240 define_ab_${tag}_rows_old_${commit}.txt python benchmarks/define_ab.py \
      --define gemm._K4_RING_MAX_M=2,gemm._K5_RING_MAX_M=0,gemm._K3_WIDE_MIN_M=65 \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 2 3 4 8 --k 3 4 5
    run 150 sanitize_wide_mma_memcheck_${tag}_rows_${commit}.txt compute-sanitizer --tool memcheck \
      python benchmarks/sanitize_wide_mma.py --ring ;;
  rows-check)  # the GPU tests of the rings and the 8- and 16-warp launches
    warm "" gemm_mma gemm_latency gemm_lut
    run 420 gpu_tests_${tag}_rows_${commit}.txt python -m pytest -q tests/test_gpu_gemm.py \
      -k "a_ring or compact_ring or dispatch_keys or eight_warp or sixteen_warp or four_warps" ;;
  ring-h100)  # (the H100) k = 5's ring of A's stages against two stages: auto, and the mma launch at 1..16 rows; k = 4's ring of 8 (off below 4 TB/s: gemm._RING_MIN_TBPS) at up to 2 and 4 rows
    warm "" gemm_mma gemm_latency gemm_lut
    warm KBIT_A_RING=0 gemm_mma
    for kern in auto mma; do
      run 200 define_ab_${tag}_a_ring_off_${kern}_${commit}.txt python benchmarks/define_ab.py \
        --define KBIT_A_RING=0,_jit.GEMM_MMA_A_RING=0 --kernel $kern \
        --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 4 8 12 16 --k 5
    done
    run 150 define_ab_${tag}_k4_ring_on_${commit}.txt python benchmarks/define_ab.py \
      --define gemm._RING_MIN_TBPS=0 --define gemm._RING_MIN_TBPS=0,gemm._K4_RING_MAX_M=4 \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 2 4 --k 4 ;;
  ring-k4)  # (run at 030d87c: up to 2 rows taken) k = 4's 8-warp ring variant (gemm._K4_RING_MAX_M) at up to 2 and 4 rows against two stages; the ring's depth on k = 5 (3, 5, 6 stages against 4)
    warm "" gemm_mma gemm_latency gemm_lut
    for dt in float16 bfloat16; do
      run 150 define_ab_${tag}_k4_ring_${commit}_${dt}.txt python benchmarks/define_ab.py \
        --define gemm._K4_RING_MAX_M=2 --define gemm._K4_RING_MAX_M=4 --dtype $dt \
        --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 8192x2048 --m 1 2 4 8 --k 4
    done
    for s in 3 5 6; do warm KBIT_A_RING=$s gemm_mma; done
    run 200 define_ab_${tag}_ring_depth_${commit}.txt python benchmarks/define_ab.py \
      --define KBIT_A_RING=3,_jit.GEMM_MMA_A_RING=3 --define KBIT_A_RING=5,_jit.GEMM_MMA_A_RING=5 \
      --define KBIT_A_RING=6,_jit.GEMM_MMA_A_RING=6 \
      --layers 8192x57344 28672x8192 4096x28672 14336x4096 4096x6144 --m 1 4 8 --k 5 ;;
  grouped-copy-warps)  # (run at 0740044: lost 1.9-2.9%; the knob is removed since) the mma.sync grouped launch's copies of A by four warps (KBIT_GROUPED_COPY_WARPS=4) against every warp
    warm "" gemm_mma gemm_latency moe_route
    for cfg in "512 10 2048x512" "128 8 2048x1536" "128 8 768x2048"; do
      set -- $cfg
      run 150 moe_gap_probe_${tag}_grouped_copy_warps_e$1_$3_${commit}.txt python benchmarks/moe_gap_probe.py \
        --experts $1 --top-k $2 --shape $3 --t 8 32 --ab KBIT_GROUPED_COPY_WARPS=4
    done ;;
  *) echo "usage: $0 ab-ksplit|ab-k5|k5-mid|ab-fold|check|fold-check|chosen-ab|ab-base|base-check|base-rest|ksplit-ab|ksplit-check|moe-ncu|moe-knobs|wg-desc|wg-desc-check|moe-table|wg-desc-sanitize|moe-quarter|moe-ncu-source|ksplit-bound|copy-warps-h100|copy-warps-ncu|grouped-copy-warps|ring-check|ring-h100|ring-k4|ring8|k3-wide-ring|compact-ring|k4-ring-check|k4-ring-ncu|memcheck|racecheck" >&2; exit 2 ;;
esac
