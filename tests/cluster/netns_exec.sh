#!/bin/bash
# Run a command "on" a namespace host: its network namespace, its own hostname (UTS namespace) and
# its own /etc/hosts (mount namespace, bind mount).  netns_exec.sh NS HOSTNAME HOSTS_FILE cmd...
set -euo pipefail
NS=$1 H=$2 HOSTS=$3
shift 3
exec nsenter --net="/run/netns/$NS" unshare --uts --mount --propagation private \
  sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$HOSTS" "$H" "$@"
