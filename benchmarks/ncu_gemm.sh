#!/usr/bin/env bash
# ncu summary of one kbit_gemm launch per case (device only): the mma kernel, or the
# one named (latency, wgmma). The clocks stay as they are (--clock-control none: never
# change the GPU's clocks); caches flushed per pass.
# usage: benchmarks/ncu_gemm.sh OUT_DIR "K_dim N M k [kernel]" ["K_dim N M k" ...]
set -u
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
out=$1; shift
mkdir -p "$out"
for c in "$@"; do
  set -- $c
  f="$out/ncu_gemm_${1}x${2}_M${3}_k${4}_${5:-mma}.txt"
  pat=${5:-mma}; [ "$pat" = cluster ] && pat=latency  # the cluster split is gemm_latency.cu's
  [ "$pat" = wgmma ] && pat=mma  # the Hopper path is gemm_mma.cu
  "$NCU" --clock-control none --kernel-name regex:kbit_gemm_$pat --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
    python benchmarks/profile_gemm.py "$1" "$2" "$3" "$4" "${5:-mma}" > "$f" 2>&1
  echo "== $c"
  grep -E "DRAM Throughput|L1/TEX Cache Throughput|Issue Slots Busy|Eligible Warps|Active Warps Per|No Eligible|Achieved Occupancy|Registers Per|Block Limit (Reg|Shared)|Duration|Shared Memory|Max Bandwidth|Mem Busy|Mem Pipes" "$f" | sed 's/  */ /g'
  grep -E "issue_stalled" "$f" | awk '$NF+0 > 0.05 {print $1, $NF}' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | sort -k2 -nr | head -8
done
