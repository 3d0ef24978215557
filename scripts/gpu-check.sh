#!/usr/bin/env bash
# On the H200 machine: configure and build with the CUDA backend, run the GPU test label
# (and compute-sanitizer over it), the tests that need PyTorch/transformers, and the
# benchmarks; print a short table last. Results also go to $OUT (when set) for collection.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
jobs=$(nproc)
log() { echo "=== $* ==="; }

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nvcc --version | tail -1; cmake --version | head -1; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || true

log "configure + build (CUDA ON)"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON 2>&1 | tail -5
cmake --build build-gpu -j "$jobs" 2>&1 | grep -E "error|warning: unused|FAILED" | head -40
[ -x build-gpu/tessera ] || { echo "build failed"; exit 1; }
build-gpu/tessera info

log "GPU tests"
(cd build-gpu && ctest -L gpu --output-on-failure 2>&1 | tee "$out/gpu-tests.log" | tail -15)

log "compute-sanitizer (memcheck, racecheck) on the GPU tests"
for tool in memcheck racecheck; do
  # The out-of-memory test provokes a failed cudaMalloc on purpose, which memcheck reports.
  compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/test_gpu_core --gtest_filter=-*OutOfMemory* > "$out/sanitizer-$tool.log" 2>&1
  echo "$tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitizer-$tool.log") clean summaries)"
done

log "tests with PyTorch / transformers references"
(cd build-gpu && ctest -R "HfConvert|Python" --output-on-failure 2>&1 | tail -8)
build-gpu/test_hf_convert --gtest_filter='*Transformers*' 2>&1 | tail -4

log "CPU benchmark: tessera vs PyTorch eager, one training step (host CPU)"
python3 bench/cpu_train_step.py --build build-gpu 2>&1 | tee "$out/bench-cpu-train-step.log"
OMP_NUM_THREADS=2 python3 bench/cpu_train_step.py --build build-gpu 2>&1 | tail -1 | tee -a "$out/bench-cpu-train-step.log"
