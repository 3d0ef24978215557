#!/usr/bin/env bash
# On a machine with two or more H200s: the NCCL tests under mpirun (a rank per GPU) and the
# data-parallel training step with the gradient reduction after the backward, overlapped with
# it (--overlap: NCCL's own stream), and skipped (--no-reduce: the compute-only baseline).
# Logs also go to $OUT (when set).
#
#   scripts/dist-check.sh [ranks]     (default: every GPU)
#
# BUILD=0 skips configure + build (build-gpu must hold test_gpu_dist_nccl and
# bench_dist_train_step). MODELS="llama3.2-1b gpt2-124m" picks the models timed.
set -uo pipefail
out=${OUT:-/tmp/dist-check}
mkdir -p "$out"
gpus=$(nvidia-smi -L | wc -l)
ranks=${1:-$gpus}
log() { echo "=== $* ==="; }
mpi=(mpirun --allow-run-as-root --oversubscribe -np "$ranks" --bind-to none -x LD_LIBRARY_PATH -x NCCL_DEBUG)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

log "machine: $gpus GPU(s), $ranks rank(s)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -6

if [ "${BUILD:-1}" != 0 ]; then
  log "configure + build"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON 2>&1 | tail -1
  cmake --build build-gpu -j "$(nproc)" --target test_gpu_dist_nccl bench_dist_train_step 2>&1 | grep -E "error|FAILED" | head -20
fi

log "NCCL tests on $ranks ranks"
"${mpi[@]}" build-gpu/test_gpu_dist_nccl 2>&1 | tee "$out/dist-nccl-tests.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|FAILED \]" | sort | uniq -c

log "data-parallel step on $ranks ranks (median step of the slowest rank)"
for model in ${MODELS:-llama3.2-1b gpt2-124m}; do
  case $model in
    llama3.2-1b) shape=(--batch 4 --seq 2048) ;;
    *) shape=(--batch 16 --seq 1024 --vocab 50304) ;;
  esac
  for mode in "" --overlap --no-reduce; do
    "${mpi[@]}" build-gpu/bench_dist_train_step --model "$model" --device cuda --precision bf16 "${shape[@]}" \
      --steps 10 --warmup 3 $mode 2>&1 | grep -E '^\{|rror' | tee -a "$out/dist-train-step.log"
  done
done
