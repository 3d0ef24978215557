#!/usr/bin/env bash
# `tessera train` on several ranks, end to end through the command line:
#   - `tessera launch --nproc 2 train` gives the 1-rank curve (same global batch), rank 0
#     alone prints, the checkpoint holds both ranks' parts and resumes on 1 rank;
#   - the same with training.parallel.tensor=2 (one tensor-parallel group of 2);
#   - a rank that exits makes the launcher stop the other and exit non-zero at once; a rank
#     that hangs makes the others stop within training.parallel.timeout_s;
#   - the same under mpirun when its command is given (the MPI watchdog for the hang).
# Usage: dist_cli_smoke.sh TESSERA [MPIEXEC [MPIEXEC FLAGS...]]
set -euo pipefail
tessera=$1
shift
mpiexec=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
for i in $(seq 1 300); do echo "In the beginning was the word, and the word was $((i % 9))."; done > "$work/text.txt"
"$tessera" prepare "$work/text.txt" --out "$work/tokens.bin" > "$work/prepare.log"
cat > "$work/run.yaml" <<YAML
model: {architecture: llama, vocab_size: 257, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2,
        intermediate_size: 64, max_seq_len: 32, rope_theta: 10000}
data: {path: $work/tokens.bin, tokenizer: byte, validation_fraction: 0.1}
optimizer: {lr: 0.01, warmup_steps: 2}
training: {steps: 6, batch_size: 2, global_batch_size: 8, seq_len: 16, eval_interval: 3, eval_batches: 2,
           checkpoint_interval: 3, out_dir: $work/one, log_interval: 1,
           parallel: {distributed_optimizer: true, timeout_s: 60}}
YAML

losses() { grep -o '"loss":[^,}]*' "$1/metrics.jsonl" | cut -d: -f2; }
# Same number of steps and every loss within 1e-5 (relative) of the reference's.
same_curve() {
  paste <(losses "$1") <(losses "$2") | awk -v what="$3" '
    { n++; d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * $2) { print what ": step " n ": " $1 " vs " $2; bad = 1 } }
    END { if (n != 6) { print what ": " n " steps instead of 6"; bad = 1 } exit bad }'
}
# Runs "$@", expects a non-zero exit within $limit seconds and $pattern on stderr.
expect_failure() {
  local limit=$1 pattern=$2 name=$3
  shift 3
  local start=$SECONDS
  if "$@" > "$work/$name.out" 2> "$work/$name.err"; then
    echo "$name: expected a failure"; cat "$work/$name.err"; exit 1
  fi
  local took=$((SECONDS - start))
  if [ "$took" -gt "$limit" ]; then echo "$name: took ${took}s (limit ${limit}s)"; exit 1; fi
  if ! grep -q -- "$pattern" "$work/$name.err"; then
    echo "$name: no '$pattern' on stderr:"; cat "$work/$name.err"; exit 1
  fi
}

"$tessera" train "$work/run.yaml" > "$work/one.log"

# ---- tessera launch ----
"$tessera" launch --nproc 2 -- train "$work/run.yaml" --set training.out_dir="$work/two" > "$work/two.log" 2> "$work/two.err"
same_curve "$work/two" "$work/one" "launch --nproc 2"
[ "$(grep -c '^train: 2 ranks (tcp)' "$work/two.log")" -eq 1 ]   # rank 0 alone prints
[ "$(grep -c '^step 6/6' "$work/two.log")" -eq 1 ]
grep -q '"ranks": 2' "$work/two/checkpoints/step-000006/manifest.json"
[ -s "$work/two/checkpoints/step-000006/optimizer-zero1-00001-of-00002.safetensors" ]
# The 2-rank checkpoint at step 3 resumes on one rank (the shards re-split) and gives the same curve.
rm -rf "$work/two/checkpoints/step-000006"
"$tessera" train "$work/run.yaml" --set training.out_dir="$work/two" --resume > "$work/resume.log"
grep -q "resumed from .*step-000003" "$work/resume.log"
same_curve "$work/two" "$work/one" "2 ranks resumed on 1"

# Tensor parallelism: 2 ranks as one TP group (the plain optimizer, clipping by the model's
# norm) give the 1-rank curve; the checkpoint is in the single-device layout, written by rank 0.
"$tessera" launch --nproc 2 train "$work/run.yaml" --set training.out_dir="$work/tp2" \
  --set training.parallel.tensor=2 --set training.parallel.distributed_optimizer=false > "$work/tp2.log" 2> "$work/tp2.err"
same_curve "$work/tp2" "$work/one" "launch --nproc 2 with training.parallel.tensor=2"
grep -q '^train: tensor parallel x 2' "$work/tp2.log"
[ -s "$work/tp2/checkpoints/step-000006/optimizer.safetensors" ]

# A rank that exits: the launcher stops the other at once and names the rank.
expect_failure 30 "rank 1 (pid [0-9]*) exited with status 3" launch_exit \
  "$tessera" launch --nproc 2 train "$work/run.yaml" --set training.out_dir="$work/exit" \
  --set training.fault_injection.rank_fault="{rank: 1, step: 2, kind: exit}"
# A rank that hangs: rank 0 gives up after timeout_s (3 s) naming it, the launcher stops the rest.
expect_failure 40 "no answer from rank(s) 1" launch_hang \
  "$tessera" launch --nproc 2 train "$work/run.yaml" --set training.out_dir="$work/hang" \
  --set training.parallel.timeout_s=3 --set training.fault_injection.rank_fault="{rank: 1, step: 2, kind: hang}"
grep -q "tessera launch: failed: rank 0 exited with status 1" "$work/launch_hang.err"

# ---- mpirun ----
if [ ${#mpiexec[@]} -gt 0 ]; then
  "${mpiexec[@]}" -np 2 "$tessera" train "$work/run.yaml" --set training.out_dir="$work/mpi" > "$work/mpi.log" 2> "$work/mpi.err"
  same_curve "$work/mpi" "$work/one" "mpirun -np 2"
  grep -q '^train: 2 ranks (mpi)' "$work/mpi.log"
  expect_failure 60 "." mpi_exit \
    "${mpiexec[@]}" -np 2 "$tessera" train "$work/run.yaml" --set training.out_dir="$work/mpi_exit" \
    --set training.fault_injection.rank_fault="{rank: 1, step: 2, kind: exit}"
  # MPI cannot interrupt a blocked collective: the watchdog ends rank 0 (status 124), mpirun the rest.
  expect_failure 60 "has not completed after" mpi_hang \
    "${mpiexec[@]}" -np 2 "$tessera" train "$work/run.yaml" --set training.out_dir="$work/mpi_hang" \
    --set training.parallel.timeout_s=3 --set training.fault_injection.rank_fault="{rank: 1, step: 2, kind: hang}"
fi
echo "distributed cli smoke test: all behaved"
