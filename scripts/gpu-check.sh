#!/usr/bin/env bash
# On the H200 machine: configure and build with the CUDA backend, then run the parts asked
# for and print a short table last. Results also go to $OUT (when set) for collection.
#
#   scripts/gpu-check.sh [tests] [sanitize] [python] [bench] [bench-compile] [attention]
#   (no argument: tests sanitize python bench)
#
#   tests          the GPU test label (every CUDA op against the CPU reference, whole models)
#   sanitize       compute-sanitizer memcheck and racecheck over the GPU test binaries
#   python         the tests whose reference is PyTorch / transformers
#   bench          training step, tessera vs PyTorch eager: GPT-2 124M and Llama-3.2-1B-shaped
#   bench-compile  the same with torch.compile as well (slower to run)
#   attention      attention kernels, tessera vs PyTorch SDPA backends
#   fp8            FP8 GEMMs against BF16 (bench_gemm), and the Llama step with FP8 linears
#                  (current and delayed scaling) against tessera BF16 and PyTorch eager
#   bandwidth      norm / elementwise / loss / FP8-cast kernels against the copy bandwidth
#   profile        where the time of a training step goes, kernel by kernel (ncu), GPT-2 and Llama
#   moe            the Mixtral expert MLP (bench_moe vs PyTorch loop and torch._grouped_mm), and a
#                  2-layer Mixtral-8x7B-shaped training step against Hugging Face
#   graph          the training step captured in a CUDA graph against the same step eager
#                  (bench_train_step --cuda-graph): GPT-2 124M and Llama-3.2-1B-shaped
#   checkpoint     training stall per checkpoint, asynchronous against synchronous saves, for the
#                  Llama-3.2-1B-shaped model (bench/checkpoint_stall.sh)
#   demo           `tessera train configs/demo.yaml --device cuda` end to end (sample + plot);
#                  the text is data/kjv.txt when present, else the repository's docs
#
# TEST_REGEX limits the GPU tests to those whose name matches (ctest -R).
# BUILD_TARGETS="a b" builds only those targets (the tessera binary is always wanted).
# SANITIZE_ONLY="name ..." limits the sanitizer to those test_gpu_<name> programs; SANITIZE_TIMEOUT (seconds,
# default 240) bounds each sanitizer run.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
jobs=$(nproc)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests sanitize python bench)
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
log() { echo "=== $* ==="; }

# The H200 has cuDNN 9.14 in the system and 9.19 in PyTorch's wheels: build against the
# wheels' (the version PyTorch runs, so side-by-side figures compare like with like), and
# let its sub-libraries load from the same directory.
cudnn_wheel=$(ls -d /opt/*/.venv/lib/python3*/site-packages/nvidia/cudnn 2>/dev/null | head -1)
if [ -n "$cudnn_wheel" ] && [ -z "${CUDNN_ROOT:-}" ]; then
  export CUDNN_ROOT=$cudnn_wheel LD_LIBRARY_PATH=$cudnn_wheel/lib:${LD_LIBRARY_PATH:-}
fi

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nvcc --version | tail -1; cmake --version | head -1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || true
git log -1 --format='commit %H' 2>/dev/null || true

log "configure + build (CUDA ON)"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON 2>&1 | tail -3
start=$(date +%s)
# BUILD_TARGETS (space-separated) limits the build to what the chosen parts run, e.g.
# BUILD_TARGETS="tessera bench_train_step" for bench / bench-compile alone.
# shellcheck disable=SC2086
cmake --build build-gpu -j "$jobs" ${BUILD_TARGETS:+--target $BUILD_TARGETS} 2>&1 | grep -E "error|FAILED" | head -40
echo "build took $(( $(date +%s) - start )) s"
[ -x build-gpu/tessera ] || { echo "build failed"; exit 1; }
build-gpu/tessera info
ldd build-gpu/tessera | grep -E "cudnn|nccl|cublas" || true

summary=()
# compute-sanitizer memcheck and racecheck over every GPU test program. The out-of-memory
# test provokes a failed cudaMalloc on purpose, which memcheck reports; whole-model curves
# are long and use only kernels the op tests cover. Programs run side by side (the GPU has
# room), each bounded in time; the whole part runs beside the plain GPU tests.
sanitize_one() {
  local tool=$1 t=$2 log="$out/sanitizer-$1-$(basename "$2").log"
  timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$t" --gtest_filter='-*OutOfMemory*:*TrainingCurves*:*AFailedCapture*' \
    > "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then echo "$tool $(basename "$t"): clean"
  elif [ $rc -eq 124 ]; then echo "$tool $(basename "$t"): TIMED OUT (${SANITIZE_TIMEOUT:-240} s)"
  else echo "$tool $(basename "$t"): FINDINGS (exit $rc)"; grep -m5 -E "Invalid|Race|hazard|Error:|FAILED" "$log"; fi
}
export -f sanitize_one
export out SANITIZE_TIMEOUT
if want sanitize; then
  log "compute-sanitizer (memcheck, racecheck) started in the background"
  for tool in memcheck racecheck; do for name in ${SANITIZE_ONLY:-*}; do for t in build-gpu/test_gpu_$name; do [ -x "$t" ] && [ "${t%.cmake}" = "$t" ] && echo "$tool $t"; done; done; done |
    xargs -P 12 -n 2 bash -c 'sanitize_one "$0" "$1"' > "$out/sanitizer.txt" 2>&1 &
  sanitizer_pid=$!
fi

if want demo; then
  log "demo on the GPU: tessera train configs/demo.yaml --device cuda"
  text=data/kjv.txt
  if [ ! -s "$text" ]; then text="$out/demo-text.txt"; cat README.md docs/*.md docs/ops/*.md > "$text"; fi
  rm -rf "$out/demo"
  build-gpu/tessera train configs/demo.yaml --device cuda --set data.text="$text" --set training.out_dir="$out/demo" \
    > "$out/demo.log" 2>&1
  echo "exit $?"
  grep -E "^train:|val_loss|step 480" "$out/demo.log" | head -12
  sed -n '/--- sample ---/,/-----------/p' "$out/demo.log" | head -12
  build-gpu/tessera plot "$out/demo" --out "$out/demo/loss.png" --title "demo on the H200" && rm -rf "$out/demo/checkpoints"
  summary+=("demo: $(grep -E '^train: step' "$out/demo.log")")
fi

if want tests; then
  log "GPU tests"
  (cd build-gpu && ctest -L gpu ${TEST_REGEX:+-R "$TEST_REGEX"} --output-on-failure -j "${CTEST_JOBS:-4}" > "$out/gpu-tests.log" 2>&1)
  grep -E "Failed|\*\*\*" "$out/gpu-tests.log" | head -20
  tail -6 "$out/gpu-tests.log"
  summary+=("gpu tests: $(grep -E 'tests passed' "$out/gpu-tests.log")")
fi

if want sanitize; then
  wait "$sanitizer_pid"
  log "compute-sanitizer results"
  sort "$out/sanitizer.txt"
  summary+=("compute-sanitizer: $(grep -c ': clean' "$out/sanitizer.txt") program runs clean, $(grep -Ec 'TIMED OUT|FINDINGS' "$out/sanitizer.txt") not")
fi

if want python; then
  log "tests with PyTorch / transformers references"
  (cd build-gpu && ctest -R "HfConvert|Python" --output-on-failure 2>&1 | tail -5)
fi

if want bench || want bench-compile; then
  log "training step on the GPU: tessera vs PyTorch (same run, same GPU)"
  extra=()
  want bench-compile && extra+=(--compile)
  python3 bench/gpu_train_step.py --build build-gpu "${extra[@]}" 2>&1 | tee "$out/bench-gpu-train-step.log"
fi

if want attention && [ -x build-gpu/bench_attention ]; then
  log "attention: tessera vs PyTorch SDPA"
  build-gpu/bench_attention 2>&1 | tee "$out/bench-attention.log"
  python3 bench/attention_torch.py 2>&1 | tee -a "$out/bench-attention.log"
fi

if want fp8; then
  log "FP8: GEMMs, then the Llama step with FP8 linears"
  build-gpu/bench_gemm 2>&1 | tee "$out/bench-gemm.log"
  python3 bench/gpu_train_step.py --build build-gpu --models llama --fp8 current --fp8 delayed 2>&1 |
    tee "$out/bench-fp8-train-step.log"
fi

if want bandwidth; then
  log "bandwidth: norm / elementwise / loss / FP8 casts at 16384x4096 BF16 vs cudaMemcpy and PyTorch"
  build-gpu/bench_bandwidth 2>&1 | tee "$out/bench-bandwidth.log"
  python3 bench/bandwidth_torch.py 2>&1 | tee -a "$out/bench-bandwidth.log"
fi

if want moe; then
  log "MoE: expert MLP and a 2-layer Mixtral step"
  build-gpu/bench_moe 2>&1 | tee "$out/bench-moe.log"
  python3 bench/moe_torch.py 2>&1 | tee -a "$out/bench-moe.log"
  python3 bench/gpu_train_step.py --build build-gpu --models mixtral2 2>&1 | tee -a "$out/bench-moe.log"
fi

if want graph; then
  log "CUDA graph: captured step against eager"
  for m in "gpt2-124m --batch 16 --seq 1024 --vocab 50304" "llama3.2-1b --batch 4 --seq 2048"; do
    # shellcheck disable=SC2086
    timeout 150 build-gpu/bench_train_step --model $m --device cuda --precision bf16 --steps 10 --warmup 3 \
      --cuda-graph 2>&1 | tail -2 | tee -a "$out/bench-graph.log"
  done
fi

if want checkpoint; then
  log "checkpoint stall: async vs sync, Llama-3.2-1B-shaped"
  bash bench/checkpoint_stall.sh build-gpu /tmp/checkpoint-stall 2>&1 | tee "$out/checkpoint-stall.log"
fi

if want profile; then
  log "profile of one training step (ncu, kernel times grouped)"
  python3 bench/profile_step.py --build build-gpu --model gpt2-124m --vocab 50304 --batch 16 --seq 1024 2>&1 |
    tee "$out/profile-gpt2.log"
  python3 bench/profile_step.py --build build-gpu --model llama3.2-1b --batch 4 --seq 2048 2>&1 |
    tee "$out/profile-llama.log"
fi

log "summary"
for line in "${summary[@]}"; do echo "$line"; done
