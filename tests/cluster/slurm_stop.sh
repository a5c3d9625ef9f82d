#!/bin/bash
# Stop daemons by their PID files (SIGTERM to all at once, then SIGKILL to those still there
# after 10 s), never by name. Each takes 1.5-2 s to end: one after another, they took 5.5 s.
#   slurm_stop.sh DIR [PIDFILE ...]   (PID files relative to DIR; default: slurm_1node.sh's)
D=$1
shift
[ $# -gt 0 ] || set -- slurmd.pid slurmctld.pid munge/munged.pid
pids=()
for name in "$@"; do
  f="$D/$name"
  [ -f "$f" ] || continue
  p=$(cat "$f")
  kill -TERM "$p" 2>/dev/null && pids+=("$p")
done
for _ in $(seq 100); do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && exit 0
  sleep 0.1
done
for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
exit 0
