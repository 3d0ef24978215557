#!/usr/bin/env bash
# Runs each libFuzzer target for a bounded time, starting from the seeds in fuzz/corpus/
# (copied, so the checked-in seeds never change). Fails on the first finding; the input
# that triggered it is left as BUILD/fuzz-findings/<target>/crash-* (or leak-*, timeout-*).
#   bash fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET]
set -euo pipefail
build=$1
seconds=${2:-30}
here=$(cd "$(dirname "$0")" && pwd)
# The targets write each input to a scratch file: memory-backed when possible.
if [ -z "${TMPDIR:-}" ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
for target in config safetensors indexed_dataset; do
  exe="$build/fuzz_$target"
  [ -x "$exe" ] || { echo "fuzz: $exe is missing (configure with -DTESSERA_FUZZ=ON)"; exit 1; }
  work=$(mktemp -d)
  cp -r "$here/corpus/$target/." "$work/"
  findings="$build/fuzz-findings/$target"
  mkdir -p "$findings"
  echo "=== fuzz_$target for ${seconds}s ==="
  # -rss_limit_mb / -malloc_limit_mb: a header may claim huge sizes; the readers must refuse
  # them rather than allocate. -timeout: no single input may take longer than 10 s.
  if ! "$exe" "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
       -artifact_prefix="$findings/" -print_final_stats=1 > "$findings/log.txt" 2>&1; then
    tail -40 "$findings/log.txt"
    echo "fuzz: fuzz_$target found a problem; the input is in $findings/"
    rm -rf "$work"
    exit 1
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added" "$findings/log.txt" | tr '\n' ' '
  echo
  rm -rf "$work"
done
echo "fuzz: no findings"
