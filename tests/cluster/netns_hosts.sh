#!/bin/bash
# Two "hosts" in their own network namespaces, joined by one veth pair and nothing else (no link to
# the machine's network): ${P}A = nodeA (10.$N.0.1), ${P}B = nodeB (10.$N.0.2).
# Adapted from shared/recipes/netns_two_nodes.sh.
#   netns_hosts.sh up   P N DIR   -> writes DIR/hosts (nodeA, nodeB; used via netns_exec.sh)
#   netns_hosts.sh down P
set -euo pipefail
cmd=$1 P=$2
if [ "$cmd" = down ]; then
  ip netns del "${P}A" 2>/dev/null || true   # deleting a namespace removes its veth end
  ip netns del "${P}B" 2>/dev/null || true
  exit 0
fi
N=$3 D=$4
ip netns add "${P}A"
ip netns add "${P}B"
ip link add "${P}a" netns "${P}A" type veth peer name "${P}b" netns "${P}B"
ip -n "${P}A" addr add "10.$N.0.1/24" dev "${P}a"
ip -n "${P}B" addr add "10.$N.0.2/24" dev "${P}b"
for ns in "${P}A" "${P}B"; do ip -n "$ns" link set lo up; done
ip -n "${P}A" link set "${P}a" up
ip -n "${P}B" link set "${P}b" up
mkdir -p "$D"
printf '127.0.0.1 localhost\n10.%s.0.1 nodeA\n10.%s.0.2 nodeB\n' "$N" "$N" > "$D/hosts"
