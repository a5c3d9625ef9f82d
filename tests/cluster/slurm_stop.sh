#!/bin/bash
# Stop daemons by their PID files (SIGTERM, then SIGKILL after 10 s), never by name.
#   slurm_stop.sh DIR [PIDFILE ...]   (PID files relative to DIR; default: slurm_1node.sh's)
D=$1
shift
[ $# -gt 0 ] || set -- slurmd.pid slurmctld.pid munge/munged.pid
for name in "$@"; do
  f="$D/$name"
  [ -f "$f" ] || continue
  p=$(cat "$f")
  kill -0 "$p" 2>/dev/null || continue
  kill -TERM "$p"
  for _ in $(seq 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$p" 2>/dev/null && kill -KILL "$p"
done
exit 0
