#!/bin/bash
# COUNT "hosts" in their own network namespaces on one bridge (an Ethernet switch), itself in a
# namespace of its own (${P}S), so nothing joins them to the machine's network: ${P}A = nodeA
# (10.$N.0.1, also named pyjob-worker-0, as a Kubeflow PyTorchJob's first worker pod), ${P}B = nodeB
# (10.$N.0.2, pyjob-worker-1), ... Adapted from netns_hosts.sh (a veth pair joins two hosts only).
#   netns_bridge.sh up   P N DIR COUNT   -> writes DIR/hosts (used via netns_exec.sh)
#   netns_bridge.sh down P COUNT
set -euo pipefail
cmd=$1 P=$2
LETTERS=(A B C D E F)
if [ "$cmd" = down ]; then
  COUNT=${3:-6}
  for ((i = 0; i < COUNT; i++)); do ip netns del "${P}${LETTERS[$i]}" 2>/dev/null || true; done
  ip netns del "${P}S" 2>/dev/null || true   # deleting a namespace removes its veth ends and bridge
  exit 0
fi
N=$3 D=$4 COUNT=$5
mkdir -p "$D"
ip netns add "${P}S"
ip -n "${P}S" link add br0 type bridge
ip -n "${P}S" link set br0 up
printf '127.0.0.1 localhost\n' > "$D/hosts"
for ((i = 0; i < COUNT; i++)); do
  L=${LETTERS[$i]} l=${LETTERS[$i],,}
  ip netns add "${P}${L}"
  ip link add "${P}${l}" netns "${P}${L}" type veth peer name "${P}s${l}" netns "${P}S"
  ip -n "${P}S" link set "${P}s${l}" master br0
  ip -n "${P}S" link set "${P}s${l}" up
  ip -n "${P}${L}" addr add "10.$N.0.$((i + 1))/24" dev "${P}${l}"
  ip -n "${P}${L}" link set lo up
  ip -n "${P}${L}" link set "${P}${l}" up
  printf '10.%s.0.%s node%s pyjob-worker-%s\n' "$N" "$((i + 1))" "$L" "$i" >> "$D/hosts"
done
