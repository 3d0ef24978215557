#!/usr/bin/env bash
# Installs the Debian packages tessera builds with, when any is missing. Safe to run often:
# it does nothing when everything is there. Needs root (or sudo) only when installing.
set -euo pipefail

packages=(
  cmake ninja-build g++ make pkg-config
  libopenblas-dev          # BLAS for the CPU GEMM
  nlohmann-json3-dev       # JSON (configs, safetensors headers, metrics)
  libyaml-cpp-dev          # YAML configs
  libcli11-dev             # command-line parsing
  libgtest-dev             # tests
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "setup: installing ${missing[*]}"
sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo_cmd apt-get update -qq
$sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
