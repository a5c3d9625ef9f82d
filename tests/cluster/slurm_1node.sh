#!/bin/bash
# A real one-node SLURM for the tests (munged + slurmctld + slurmd as root), all state under $1.
# Adapted from shared/recipes/start_slurm.sh. Stop with slurm_stop.sh $1 (by PID, never by name).
set -euo pipefail
D=$1
H=$(hostname)
mkdir -p "$D/munge" "$D/state" "$D/spool"
[ -f "$D/munge/munge.key" ] || mungekey -c -k "$D/munge/munge.key"
chown -R munge:munge "$D/munge"; chmod 700 "$D/munge"; chmod 600 "$D/munge/munge.key"; chmod 755 "$D/munge"
runuser -u munge -- /usr/sbin/munged --force --key-file="$D/munge/munge.key" \
  --socket="$D/munge/munge.socket.2" --pid-file="$D/munge/munged.pid" \
  --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
CTL_PORT=$2
cat > "$D/slurm.conf" <<CONF
ClusterName=odtest
SlurmctldHost=$H(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket.2
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTL_PORT
SlurmdPort=$((CTL_PORT + 1))
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdTimeout=60
NodeName=$H NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$D/slurm.conf
/usr/sbin/slurmctld -f "$D/slurm.conf"
/usr/sbin/slurmd -f "$D/slurm.conf"
for _ in $(seq 60); do sinfo -h -o %T 2>/dev/null | grep -q idle && exit 0; sleep 0.5; done
echo "SLURM did not become idle" >&2; exit 1
