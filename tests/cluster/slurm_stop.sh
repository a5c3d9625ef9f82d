#!/bin/bash
# Stop the daemons of slurm_1node.sh by their PID files (SIGTERM, then SIGKILL after 10 s).
D=$1
for f in "$D/slurmd.pid" "$D/slurmctld.pid" "$D/munge/munged.pid"; do
  [ -f "$f" ] || continue
  p=$(cat "$f")
  kill -0 "$p" 2>/dev/null || continue
  kill -TERM "$p"
  for _ in $(seq 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$p" 2>/dev/null && kill -KILL "$p"
done
exit 0
