#!/usr/bin/env bash
# The README's main job: get the corpus, train the demo model (configs/demo.yaml), sample
# from it, and draw the loss curves.
set -euo pipefail
build=${1:-build}
bash scripts/get-corpus.sh data/kjv.txt
rm -rf runs/demo
"$build/tessera" train configs/demo.yaml
"$build/tessera" plot runs/demo --out runs/demo/loss.png --title "tessera demo: byte-level Llama on the King James Bible"
echo "demo: loss curves in runs/demo/loss.png, metrics in runs/demo/metrics.jsonl, checkpoint in runs/demo/checkpoints/"
