#!/usr/bin/env bash
# Builds bench/attention_bwd_probe.cu WITHOUT libtessera: nvcc on the wgmma attention
# backward's kernel files only, into build-probe/attention_bwd_probe. The binary links the CUDA
# runtime statically and needs only libstdc++ and libc, so it runs on the H200 as built here:
# copy it under a carried path and run it there (a device call of seconds instead of a library
# build of minutes).
#
#   scripts/attention-bwd-probe.sh            # build
#   build-probe/attention_bwd_probe [--check-only | --time-only]
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p build-probe
"$nvcc" -O3 -std=c++17 --expt-relaxed-constexpr -DTESSERA_WITH_CUDA=1 -I include -I src \
  --generate-code=arch=compute_90a,code=sm_90a -o build-probe/attention_bwd_probe \
  bench/attention_bwd_probe.cu src/backend/cuda/attention_bwd_wgmma.cu \
  src/backend/cuda/tensor_map.cu src/core/error.cpp
echo "built build-probe/attention_bwd_probe"
