#!/usr/bin/env bash
# How long training stalls per checkpoint, asynchronous against synchronous saves, for the
# Llama-3.2-1B-shaped model (1.24B parameters; a checkpoint holds BF16 weights, FP32
# masters and both Adam moments, about 17 GB). Runs `tessera train` twice on the same config
# and seed, differing only in training.async_checkpoint, and prints the trainer's own
# end-of-run line (mean and largest stall per checkpoint) and each save's metrics line
# (its stall, and the part of it spent waiting for the previous write) for each. The disk
# decides how long a write takes; an asynchronous save only stalls for the copy to pinned
# host memory when the previous write has finished.
#
#   bench/checkpoint_stall.sh BUILD_DIR [OUT_DIR]
#
# Needs a GPU and about 40 GB of free disk (one checkpoint kept at a time per run; the
# first run's directory is removed before the second starts).
set -euo pipefail
build=${1:?usage: bench/checkpoint_stall.sh BUILD_DIR [OUT_DIR]}
out=${2:-/tmp/checkpoint-stall}
mkdir -p "$out"
# Any text will do: the figure is about bytes saved, not about what is learned.
cat README.md docs/*.md > "$out/text.txt"
cat > "$out/llama-1b.yaml" <<YAML
model:
  architecture: llama
  vocab_size: 128256
  hidden_size: 2048
  num_layers: 16
  num_heads: 32
  num_kv_heads: 8
  intermediate_size: 8192
  max_seq_len: 2048
  rope_theta: 500000
  tie_embeddings: true
data: {text: $out/text.txt, tokenizer: byte, validation_fraction: 0.05}
optimizer: {lr: 0.0003, warmup_steps: 5}
training:
  device: cuda
  precision: bf16
  steps: 40
  batch_size: 4
  seq_len: 2048
  eval_interval: 0
  log_interval: 10
  checkpoint_interval: 20
  checkpoint_keep_last: 1
  rewind: {enabled: false}
  seed: 7
YAML
for mode in true false; do
  dir="$out/run-async-$mode"
  rm -rf "$dir"
  echo "=== async_checkpoint: $mode ==="
  "$build/tessera" train "$out/llama-1b.yaml" --set training.async_checkpoint=$mode \
    --set training.out_dir="$dir" 2>&1 | grep -E "checkpoint|stalled|tokens/s|error" | tail -8
  # Each save's own stall and how much of it was waiting for the previous write.
  grep checkpoint_stall_ms "$dir/metrics.jsonl" 2>/dev/null || true
  du -sh "$dir" 2>/dev/null || true
  rm -rf "$dir"
done
