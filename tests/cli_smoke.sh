#!/usr/bin/env bash
# End-to-end check of the `tessera` tool on a tiny corpus: prepare, train, resume, eval
# (with logits dump), generate, convert both ways, plot, and clear errors on bad input.
# Output is captured to files before grep, so an early-exiting grep never breaks a pipe.
set -euo pipefail
tessera=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 1 300); do echo "In the beginning was the word, and the word was $((i % 9))."; done > "$work/text.txt"

"$tessera" prepare "$work/text.txt" --out "$work/tokens.bin" > "$work/prepare.log"
grep -q "wrote" "$work/prepare.log"
cat > "$work/run.yaml" <<YAML
model: {architecture: llama, vocab_size: 257, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 2,
        intermediate_size: 64, max_seq_len: 32, rope_theta: 10000}
data: {path: $work/tokens.bin, tokenizer: byte, validation_fraction: 0.1}
optimizer: {lr: 0.01, warmup_steps: 2}
training: {steps: 6, batch_size: 4, seq_len: 16, eval_interval: 3, eval_batches: 2, out_dir: $work/run,
           sample_prompt: "In the", sample_tokens: 10}
YAML
"$tessera" train "$work/run.yaml" --set training.steps=3 --set training.checkpoint_interval=1 > "$work/train.log"
[ -s "$work/run/checkpoints/step-000003/manifest.json" ]
# Damage the newest checkpoint: --resume auto skips it (warning on stderr) for the one before.
printf '\377' | dd of="$work/run/checkpoints/step-000003/model.safetensors" bs=1 seek=200 conv=notrunc 2> /dev/null
"$tessera" train "$work/run.yaml" --resume auto > "$work/resume.log" 2> "$work/resume.err"
grep -q "resumed from .*step-000002" "$work/resume.log"
grep -q "skipping checkpoint .*step-000003.*corrupt" "$work/resume.err"
[ "$(grep -c '"loss"' "$work/run/metrics.jsonl")" -eq 6 ]
"$tessera" train "$work/run.yaml" --resume > "$work/resume2.log"   # plain --resume: the same as auto
grep -q "resumed from .*step-000006" "$work/resume2.log"
"$tessera" eval "$work/run" --data "$work/tokens.bin" --seq-len 16 --batches 2 --dump-logits "$work/logits.safetensors" > "$work/eval.log"
grep -q perplexity "$work/eval.log"
[ -s "$work/logits.safetensors" ]
"$tessera" generate "$work/run" --prompt "In the" --tokens 8 --seed 3 > "$work/gen1.txt"
"$tessera" generate "$work/run" --prompt "In the" --tokens 8 --seed 3 > "$work/gen2.txt"
cmp -s "$work/gen1.txt" "$work/gen2.txt"   # same seed, same text
"$tessera" convert --to-hf "$work/hf" --from "$work/run"
[ -s "$work/hf/config.json" ] && [ -s "$work/hf/model.safetensors" ]
"$tessera" convert --from-hf "$work/hf" --to "$work/back"
"$tessera" train "$work/run.yaml" --set training.steps=1 --set training.out_dir="$work/ft" --set training.init_from="$work/hf" \
  > "$work/ft.log"
grep -q "initialised from" "$work/ft.log"
"$tessera" plot "$work/run" "$work/ft" --out "$work/loss.png" > "$work/plot.log"
grep -q "wrote" "$work/plot.log"
[ "$(head -c 4 "$work/loss.png" | od -An -c | tr -d ' ')" = "211PNG" ]

# Bad input: one clear line on stderr, non-zero exit, nothing written.
expect_error() {
  if "$@" > "$work/out.txt" 2> "$work/err.txt"; then echo "expected an error from: $*"; exit 1; fi
  grep -q "error" "$work/err.txt" || { echo "no error message from: $*"; cat "$work/err.txt"; exit 1; }
}
expect_error "$tessera" train "$work/run.yaml" --set training.batchsize=3
expect_error "$tessera" train "$work/run.yaml" --set model.num_heads=5
head -c 100 "$work/tokens.bin" > "$work/short.bin"
expect_error "$tessera" eval "$work/run" --data "$work/short.bin"
echo "not yaml: [" > "$work/bad.yaml"
expect_error "$tessera" train "$work/bad.yaml"
expect_error "$tessera" train "$work/run.yaml" --resume "$work/no-such-checkpoint"
expect_error "$tessera" train "$work/run.yaml" --resume "$work/run/checkpoints/step-000003"   # the damaged one
echo "cli smoke test: all commands behaved"
