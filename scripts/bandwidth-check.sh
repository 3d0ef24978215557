#!/usr/bin/env bash
# On the H200 machine: build the bandwidth benchmark and the GPU tests of the kernels it
# times, run the tests, then bench_bandwidth (tessera) and bench/bandwidth_torch.py
# (PyTorch), one after the other on the same GPU. Logs also go to $OUT (when set).
#
#   scripts/bandwidth-check.sh [runs]
#
# NCU='op=kernel_regex[,op=kernel_regex...]' additionally profiles one launch of the kernel
# matching kernel_regex while bench_bandwidth runs only the ops whose name contains `op`
# (Nsight Compute: speed of light, occupancy, launch stats; full reports in $OUT).
# TESTS=0 skips the tests, TORCH=0 the PyTorch side, TORCH_COMPILE=0 its torch.compile part.
set -uo pipefail
out=${OUT:-/tmp/bandwidth-check}
mkdir -p "$out"
runs=${1:-30}
log() { echo "=== $* ==="; }
tests=(test_gpu_norm test_gpu_add_norm test_gpu_elementwise test_gpu_softmax test_gpu_loss test_gpu_quantize)

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
nvcc --version | tail -1

log "configure + build (bench_bandwidth and the kernels' GPU tests)"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON 2>&1 | tail -2
[ "${TESTS:-1}" = 0 ] && tests=()
cmake --build build-gpu -j 16 --target bench_bandwidth "${tests[@]}" 2>&1 | grep -E "error|FAILED" | head -40
echo "build took $(( $(date +%s) - start )) s"
[ -x build-gpu/bench_bandwidth ] || { echo "build failed"; exit 1; }

status=0
log "GPU tests"
for t in "${tests[@]}"; do
  if [ -x "build-gpu/$t" ]; then
    "build-gpu/$t" > "$out/$t.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "$t: exit $rc, $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]' "$out/$t.log" | tr '\n' ' ')"
    grep -E "^\[  FAILED  \]|Failure|error:" "$out/$t.log" | head -10
  else
    echo "$t: not built"; status=1
  fi
done

log "bench_bandwidth (tessera)"
build-gpu/bench_bandwidth "$runs" 2>&1 | tee "$out/bench-bandwidth.log"

if [ -n "${NCU:-}" ]; then
  IFS=',' read -ra pairs <<< "$NCU"
  for p in "${pairs[@]}"; do
    f=${p%%=*} k=${p#*=}
    log "ncu: op $f, kernel $k"
    ncu --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      build-gpu/bench_bandwidth 1 "$f" > "$out/ncu-$f.log" 2>&1
    grep -E "^  [a-z].*\(|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Size|Grid Size|Waves Per SM|Block Limit (Reg|Shared|Warps)" \
      "$out/ncu-$f.log" | cut -c1-160
  done
fi

if [ "${TORCH:-1}" != 0 ]; then
  log "bench/bandwidth_torch.py (PyTorch)"
  extra=()
  [ "${TORCH_COMPILE:-1}" = 0 ] && extra+=(--no-compile)
  python3 bench/bandwidth_torch.py "$runs" "${extra[@]}" 2>&1 | tee "$out/bench-bandwidth-torch.log"
fi
exit $status
