#!/usr/bin/env bash
# Runs N copies of a program as ranks 0..N-1 of one TCP world (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), as `tessera launch` starts ranks, for test binaries that are not
# tessera subcommands. Fails when any rank fails. Usage: run_ranks.sh N PROGRAM [ARGS...]
set -u
n=$1
shift
# A port nobody listens on (bash's /dev/tcp connects when someone does).
for _ in $(seq 1 50); do
  port=$((20000 + RANDOM % 30000))
  (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null || break
done
pids=()
for rank in $(seq 0 $((n - 1))); do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
exit $status
