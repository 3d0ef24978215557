#!/usr/bin/env bash
# On the H200 machine: build the attention targets (tessera's kernels and the cuDNN backend),
# run the cuDNN attention tests, the attention benchmark and tessera's attention tests, each
# within what is left of a time budget. Full logs go to $OUT (when set); the console gets
# the summaries.
#
#   scripts/cudnn-attention-check.sh [budget_seconds]     (default 280)
#
# TESSERA_CUDNN_VERBOSE=1 makes the cuDNN backend print one line per execution plan it
# builds (operation count, engines found by the heuristics, each config's status, the
# workspace); cuDNN's own error log (CUDNN_LOGLEVEL_DBG=1) goes to $OUT/cudnn_errors.log.
set -uo pipefail
budget=${1:-280}
start=$(date +%s)
left() { echo $(( start + budget - $(date +%s) )); }
out=${OUT:-/tmp/cudnn-attention-check}
mkdir -p "$out"
log() { echo "=== $* ($(( $(date +%s) - start )) s) ==="; }

log "machine"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
wheels=$(ls -d /opt/*/.venv/lib/python3*/site-packages/nvidia 2>/dev/null | head -1)
echo "nvidia wheels: ${wheels:-none}"
[ -n "$wheels" ] && ls "$wheels" | tr '\n' ' ' && echo && ls "$wheels"/cudnn/lib 2>/dev/null | tr '\n' ' ' && echo
# cuDNN loads its engine libraries and NVRTC (runtime-compiled engines) at run time.
for d in "$wheels"/cudnn/lib "$wheels"/cuda_nvrtc/lib "$wheels"/cu13/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

log "configure + build"
# Another libcudnn.so may sit in the system's library directory: link the one whose headers
# the build uses (the wheel's), or its symbols and version may not match them.
ls -la /usr/lib/x86_64-linux-gnu/libcudnn* 2>/dev/null | head -5
grep -h "define CUDNN_M[AI][JN]OR" /usr/include/cudnn_version*.h /usr/include/x86_64-linux-gnu/cudnn_version*.h 2>/dev/null
cudnn_args=()
if [ -f "$wheels/cudnn/lib/libcudnn.so.9" ]; then
  cudnn_args=(-DTESSERA_CUDNN_LIBRARY="$wheels/cudnn/lib/libcudnn.so.9" -DTESSERA_CUDNN_INCLUDE="$wheels/cudnn/include")
fi
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON "${cudnn_args[@]}" 2>&1 | grep -E "tessera:|Error"
cmake --build build-gpu -j "$(nproc)" --target test_gpu_attention_cudnn test_gpu_attention bench_attention \
  > "$out/build.log" 2>&1 || { grep -v "^\[" "$out/build.log" | cut -c1-300 | tail -40; }
for b in test_gpu_attention_cudnn test_gpu_attention bench_attention; do
  [ -x build-gpu/$b ] || { echo "build failed: no build-gpu/$b"; exit 1; }
done
ldd build-gpu/test_gpu_attention_cudnn | grep -E "cudnn|cudart|not found"

log "cuDNN attention tests"
TESSERA_CUDNN_VERBOSE=1 CUDNN_LOGLEVEL_DBG=1 CUDNN_LOGDEST_DBG=/tmp/cudnn_errors.log \
  timeout $(( $(left) - 70 )) build-gpu/test_gpu_attention_cudnn > "$out/test_cudnn.log" 2>&1
echo "exit status $?"
grep -E "^tessera|^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|error|Expected|Which is|relative|cuDNN [0-9]|auto:|dq|dk|dv|out|lse" \
  "$out/test_cudnn.log" | cut -c1-400 | head -150
head -c 15000000 /tmp/cudnn_errors.log > "$out/cudnn_errors.log" 2>/dev/null
echo "cuDNN error log: $(wc -l < /tmp/cudnn_errors.log 2>/dev/null || echo 0) lines"

log "attention benchmark"
timeout $(( $(left) - 25 )) build-gpu/bench_attention > "$out/bench.log" 2>&1
echo "exit status $?"
cat "$out/bench.log" | cut -c1-300

log "tessera attention tests"
timeout $(( $(left) > 5 ? $(left) : 5 )) build-gpu/test_gpu_attention > "$out/test_tessera.log" 2>&1
echo "exit status $?"
grep -E "^\[ *(FAILED|PASSED) *\]|Failure" "$out/test_tessera.log" | head -20
log "done"
