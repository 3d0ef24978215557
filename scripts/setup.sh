#!/usr/bin/env bash
# Installs the Debian packages tessera builds with, when any is missing. Safe to run often:
# it does nothing when everything is there. Needs root (or sudo) only when installing.
set -euo pipefail

packages=(
  cmake ninja-build g++ make pkg-config
  libopenblas-openmp-dev   # BLAS for the CPU GEMM (OpenMP build: shares tessera's threads)
  nlohmann-json3-dev       # JSON (configs, safetensors headers, metrics)
  libyaml-cpp-dev          # YAML configs
  libcli11-dev             # command-line parsing
  libgtest-dev             # tests
  zlib1g-dev               # PNG compression (tessera plot)
  libopenmpi-dev openmpi-bin  # MPI: dist/'s CPU backend and the mpirun tests
)

# `make fuzz` (FUZZ=1): clang, its libFuzzer runtime and its OpenMP.
if [ "${FUZZ:-0}" = 1 ]; then
  packages+=(clang libclang-rt-dev libomp-dev)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python packages that serve as independent references in tests (the tests skip, saying
# so, without them). Best effort: the build does not need them.
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import numpy, safetensors, tokenizers" >/dev/null 2>&1; then
  echo "setup: installing the Python references numpy, safetensors and tokenizers (pip)"
  python3 -m pip install --quiet numpy safetensors tokenizers || echo "setup: pip install failed; Python reference tests will skip"
fi