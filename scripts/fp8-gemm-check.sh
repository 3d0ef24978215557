#!/usr/bin/env bash
# On the H200 machine: build only the FP8 GEMM targets (CUDA on), then run the GPU FP8 GEMM
# test, the CPU FP8 tests and the GEMM benchmark (cuBLASLt BF16 vs tessera FP8). Logs also
# go to $OUT (when set).
#
#   scripts/fp8-gemm-check.sh [bench runs, default 25]
set -uo pipefail
out=${OUT:-/tmp/fp8-gemm-check}
mkdir -p "$out"
runs=${1:-25}
log() { echo "=== $* ==="; }

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
nvcc --version | tail -1

targets=(test_gpu_fp8_gemm test_fp8_quantized_tensor test_fp8_block_quantized_tensor test_fp8_recipe bench_gemm)
log "configure + build ${targets[*]}"
echo "device clock: $(date -u +%FT%TZ)"
# A warm machine keeps build-gpu from earlier runs, and the copied tree keeps this tree's
# modification times: an object built there earlier can look newer than a source edited
# here since (clock skew), and ninja would keep it. So every file changed since the last
# commit is touched first; if the build still fails, everything is, and it builds again.
changed=$( (git ls-files -m -o --exclude-standard -- src include tests bench CMakeLists.txt 2>/dev/null) ||
  true)
[ -n "$changed" ] || changed=$(ls src/fp8/* src/backend/cuda/gemm_fp8.* include/tessera/fp8/* tests/test_*fp8*.cpp bench/gemm_bench.cu)
touch $changed
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON > "$out/configure.log" 2>&1 ||
  { tail -20 "$out/configure.log"; exit 1; }
if ! ninja -C build-gpu -j 16 "${targets[@]}" > "$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -10
  echo "incremental build failed after $(( $(date +%s) - start )) s; touching every source and building again"
  find src include tests bench -type f -exec touch {} +
  ninja -C build-gpu -j 16 "${targets[@]}" > "$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
fi
echo "build took $(( $(date +%s) - start )) s"

log "CPU FP8 tests"
for t in test_fp8_quantized_tensor test_fp8_block_quantized_tensor test_fp8_recipe; do
  build-gpu/$t > "$out/$t.log" 2>&1; echo "$t: exit $? ($(grep -E '^\[  (PASSED|FAILED) ' "$out/$t.log" | tr '\n' ' '))"
done

log "GPU FP8 GEMM test"
timeout 120 build-gpu/test_gpu_fp8_gemm > "$out/test_gpu_fp8_gemm.log" 2>&1
echo "test_gpu_fp8_gemm: exit $? (full log with the measured errors: test_gpu_fp8_gemm.log)"
grep -E "Failure|FAILED|Expected|Which is|rel err|: [a-z].*(16|E5M2|BF16|4)|codes one step|^\[  (PASSED|FAILED) " "$out/test_gpu_fp8_gemm.log" |
  grep -vE "ta=[01] tb=[01] (F32|BF16)" | head -60

log "GEMM benchmark"
timeout 100 build-gpu/bench_gemm "$runs" 2>&1 | tee "$out/bench_gemm.log"
echo "bench_gemm: exit ${PIPESTATUS[0]}"
