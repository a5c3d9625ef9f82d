#!/bin/bash
# A real 2-node SLURM on one machine for the tests (adapted from shared/recipes/start_slurm_netns.sh):
# slurmctld in netns ${P}S (hostname ctl, 10.$N.1.1), slurmd in ${P}1 / ${P}2 (hostnames node1 /
# node2, 10.$N.1.2 / .3), joined by a bridge in ${P}S and nothing else. munged serves all three.
#   slurm_2node_netns.sh up P N DIR     (clients: nsenter -t $(cat DIR/slurmctld.pid) -n -u -m ...)
#   slurm_2node_netns.sh down P DIR     (daemons stopped by PID, never by name)
set -euo pipefail
cmd=$1 P=$2
if [ "$cmd" = down ]; then
  D=$3
  bash "$(dirname "$0")/slurm_stop.sh" "$D" slurmd-node1.pid slurmd-node2.pid slurmctld.pid munge/munged.pid
  for ns in "${P}1" "${P}2" "${P}S"; do ip netns del "$ns" 2>/dev/null || true; done
  exit 0
fi
N=$3 D=$4
mkdir -p "$D/munge" "$D/state" "$D/spool-node1" "$D/spool-node2"
[ -f "$D/munge/munge.key" ] || mungekey -c -k "$D/munge/munge.key"
chown -R munge:munge "$D/munge"; chmod 755 "$D/munge"; chmod 600 "$D/munge/munge.key"
runuser -u munge -- /usr/sbin/munged --force --key-file="$D/munge/munge.key" \
  --socket="$D/munge/munge.socket.2" --pid-file="$D/munge/munged.pid" \
  --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
ip netns add "${P}S"; ip -n "${P}S" link set lo up
ip -n "${P}S" link add br0 type bridge
ip -n "${P}S" addr add "10.$N.1.1/24" dev br0; ip -n "${P}S" link set br0 up
for n in 1 2; do
  ip netns add "${P}$n"; ip -n "${P}$n" link set lo up
  ip link add eth0 netns "${P}$n" type veth peer name "v$n" netns "${P}S"
  ip -n "${P}S" link set "v$n" master br0; ip -n "${P}S" link set "v$n" up
  ip -n "${P}$n" addr add "10.$N.1.$((n + 1))/24" dev eth0; ip -n "${P}$n" link set eth0 up
done
printf '127.0.0.1 localhost\n10.%s.1.1 ctl\n10.%s.1.2 node1\n10.%s.1.3 node2\n' "$N" "$N" "$N" > "$D/hosts"
cat > "$D/slurm.conf" <<CONF
ClusterName=odnetns
SlurmctldHost=ctl(10.$N.1.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket.2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool-%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName=node1 NodeAddr=10.$N.1.2 CPUs=$(nproc) State=UNKNOWN
NodeName=node2 NodeAddr=10.$N.1.3 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
# nsenter --net, not `ip netns exec` (which remounts /sys; slurmd then misses /sys/fs/cgroup)
host() { ns=$1 h=$2; shift 2
  nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$D/hosts" "$h" "$@"; }
host "${P}S" ctl /usr/sbin/slurmctld -f "$D/slurm.conf"
host "${P}1" node1 /usr/sbin/slurmd -f "$D/slurm.conf" -N node1
host "${P}2" node2 /usr/sbin/slurmd -f "$D/slurm.conf" -N node2
for _ in $(seq 60); do
  [ -f "$D/slurmctld.pid" ] && \
  [ "$(nsenter -t "$(cat "$D/slurmctld.pid")" -n -u -m env SLURM_CONF="$D/slurm.conf" sinfo -h -N -o %T 2>/dev/null | grep -c '^idle')" = 2 ] && exit 0
  sleep 0.5
done
echo "the 2-node SLURM did not become idle" >&2; exit 1
