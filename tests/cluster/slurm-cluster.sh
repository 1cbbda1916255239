#!/usr/bin/env bash
# A real Slurm 22.05 test cluster on this one machine, for jobgen's integration tests: eight
# nodes like GPU nodes (two groups of four, so that two groups of tests run side by side), and two
# that are exactly this machine for the CPU-binding tests.
#
#   tests/cluster/slurm-cluster.sh start    # idempotent: does nothing if the cluster is healthy
#   tests/cluster/slurm-cluster.sh status   # prints sinfo; exit 0 if healthy, 1 if not
#   tests/cluster/slurm-cluster.sh stop     # stops what start started; exit 0 if nothing ran
#
# Needs root and the Debian packages slurm-wlm slurm-wlm-torque munge.
#
# What a test may rely on once `start` has returned 0:
#   - plain sbatch/srun/squeue/scontrol work with no extra environment (config in /etc/slurm);
#   - nodes node1..node4 (names resolve to 127.0.0.1 via /etc/hosts), each declared like a GPU
#     node (CPUs=128, RealMemory=2000000, trusted by config_overrides) so real job files fit, and
#     8 fake GPUs (gres gpu:8, character devices that are copies of /dev/null), all idle;
#   - partitions `debug` (default, PriorityTier=1, PreemptMode=REQUEUE, GraceTime=30) and
#     `high` (PriorityTier=10, PreemptMode=OFF) over all four nodes (PreemptType=
#     preempt/partition_prio): an --exclusive job in `high` preempts a running `debug` job; its
#     steps get SIGTERM at once, and a job still running after the grace time is killed and
#     requeued (a job that exits 0 within the grace time ends COMPLETED, not requeued);
#   - a third partition `gpu`, like `debug` but not the default;
#   - partition `side` of node5..node8, declared like node1..4 and used by no other partition
#     (PreemptMode=OFF): the tests that preempt nothing run there, beside those that preempt
#     `debug`, without queueing behind them;
#   - tasks are bound to CPUs as at most sites (TaskPlugin=task/affinity, Slurm's automatic
#     binding; a job may ask for binding to cores itself, e.g. SLURM_CPU_BIND=cores). Not on
#     node1..8 (CpuBind=none): their 128 CPUs are Slurm's bookkeeping, and binding would map a task
#     onto images of this machine's few real CPUs, or fail to lay out one of more CPUs than the
#     machine has ("Unable to layout tasks on given cpus": every exclusive job there);
#   - partition `bind` of nodes bind1 and bind2, declared exactly as this machine is (`slurmd
#     -C`), 8 fake GPUs each and used by no other partition: there a task's CPU binding is that of
#     a real node. Each has all of this machine's CPUs, so a job asking for all of them has one
#     node to itself;
#   - accounts `research` and `ml` (or none) are accepted and any other --account is refused at
#     submission, by a job_submit.lua plugin: without an accounting daemon Slurm cannot tell a
#     valid account from a bogus one itself. (Partition AllowAccounts=research,ml was tried:
#     every job, --account=ml included, then pends with "Job's account not known".)
#   - no accounting daemon: sacct does not work, squeue and `scontrol show job` do.
#
# State (pid files, logs, spool and state-save dirs, fake GPU devices) lives in
# ${JOBGEN_SLURM_DIR:-/var/tmp/jobgen-slurm}.
set -euo pipefail

STATE=${JOBGEN_SLURM_DIR:-/var/tmp/jobgen-slurm}
CONF_DIR=/etc/slurm
NODES=(node1 node2 node3 node4 node5 node6 node7 node8 bind1 bind2)
START_TIMEOUT_S=60
STOP_TIMEOUT_S=20
# Set when start-up fails; read by the EXIT trap so that a half-started cluster is stopped.
START_FAILED=0

die() {
    local code=$1
    shift
    echo "slurm-cluster.sh: $*" >&2
    exit "$code"
}

require_root_and_packages() {
    if [[ $EUID -ne 0 ]]; then
        die 2 "must run as root (it writes /etc/slurm and /etc/hosts and starts slurmctld, slurmd and munged)"
    fi
    local missing=()
    local tool
    for tool in slurmctld slurmd munged munge unmunge sinfo sbatch; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    if ((${#missing[@]})); then
        die 3 "missing ${missing[*]}: install the Slurm packages with: apt-get install -y slurm-wlm slurm-wlm-torque munge"
    fi
}

pid_alive() {
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

# True when slurmctld answers and every node is usable (idle, mixed or allocated).
cluster_healthy() {
    pid_alive "$STATE/slurmctld.pid" || return 1
    local states
    states=$(timeout 10 sinfo -N -h -o '%N %t' 2>/dev/null | sort -u) || return 1
    local node
    for node in "${NODES[@]}"; do
        grep -Eq "^$node (idle|mix|alloc)\$" <<<"$states" || return 1
    done
}

# This machine's CPU layout as slurmd sees it (CPUs=2 Boards=1 SocketsPerBoard=1 ...).
this_machine() {
    slurmd -C | head -n 1 | grep -oE '(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=[0-9]+' | paste -sd ' '
}

slurm_conf() {
    cat <<EOF
# Written by tests/cluster/slurm-cluster.sh: a ten-node test cluster on one machine.
ClusterName=jobgen-test
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The machine has fewer cores than CPUs=128; trust the config so real job files fit.
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# Job ids far from the PBS test servers' (counted from 0): the tests run beside each other, and a
# job's automatic MASTER_PORT is derived from its id, on the one address every test node shares.
FirstJobId=50000
# Refuse at submission what a partition can never run (e.g. -N5 here), as most sites do; the
# default queues such a job, and it pends forever.
EnforcePartLimits=ALL
JobSubmitPlugins=lua
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

StateSaveLocation=$STATE/state
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

# Short timeouts keep the tests fast; MinJobAge keeps finished jobs in scontrol for 5 minutes.
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
MinJobAge=300
InactiveLimit=0
Waittime=0
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5

PreemptType=preempt/partition_prio
PreemptMode=REQUEUE

GresTypes=gpu
NodeName=node[1-4] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-17004 CPUs=128 RealMemory=2000000 Gres=gpu:8 CpuBind=none State=UNKNOWN
NodeName=node[5-8] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17007-17010 CPUs=128 RealMemory=2000000 Gres=gpu:8 CpuBind=none State=UNKNOWN
NodeName=bind[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17005-17006 $(this_machine) RealMemory=1000 Gres=gpu:8 State=UNKNOWN
# AllowAccounts=ALL: a list of accounts needs slurmdbd; without it every job is refused.
PartitionName=debug Nodes=node[1-4] Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 MaxTime=INFINITE State=UP AllowAccounts=ALL
PartitionName=high Nodes=node[1-4] PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP AllowAccounts=ALL
PartitionName=gpu Nodes=node[1-4] PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 MaxTime=INFINITE State=UP AllowAccounts=ALL
PartitionName=side Nodes=node[5-8] PriorityTier=1 PreemptMode=OFF MaxTime=INFINITE State=UP AllowAccounts=ALL
PartitionName=bind Nodes=bind[1-2] PriorityTier=1 PreemptMode=OFF MaxTime=INFINITE State=UP AllowAccounts=ALL
EOF
}

# What a site with an accounting daemon does for accounts, done by a job_submit plugin: only
# `research` and `ml` exist; any other --account is refused at submission with Slurm's own error.
job_submit_lua() {
    cat <<'EOF'
local known_accounts = { research = true, ml = true }

function slurm_job_submit(job_desc, part_list, submit_uid)
    local account = job_desc.account
    if account ~= nil and account ~= "" and not known_accounts[account] then
        slurm.log_user("account '" .. account .. "' does not exist on this cluster (known: research, ml)")
        return slurm.ESLURM_INVALID_ACCOUNT or slurm.ERROR
    end
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end
EOF
}

gres_conf() {
    cat <<EOF
# Written by tests/cluster/slurm-cluster.sh: fake GPUs (copies of /dev/null).
AutoDetect=off
NodeName=node[1-8],bind[1-2] Name=gpu File=$STATE/dev/gpu[0-7]
EOF
}

# True when /etc/slurm holds what this version of the script writes, so a running cluster can be
# kept; after an edit of this script, start restarts the cluster with the new config.
config_current() {
    cmp -s <(slurm_conf) "$CONF_DIR/slurm.conf" && cmp -s <(gres_conf) "$CONF_DIR/gres.conf" &&
        cmp -s <(job_submit_lua) "$CONF_DIR/job_submit.lua"
}

write_config() {
    mkdir -p "$CONF_DIR" "$STATE/log" "$STATE/state" "$STATE/dev"
    local node i
    for node in "${NODES[@]}"; do
        mkdir -p "$STATE/spool/$node"
    done
    # Eight fake GPUs per node: Slurm only needs a device file per GPU to hand out.
    for i in 0 1 2 3 4 5 6 7; do
        [[ -c $STATE/dev/gpu$i ]] || mknod "$STATE/dev/gpu$i" c 1 3
    done
    slurm_conf >"$CONF_DIR/slurm.conf"
    gres_conf >"$CONF_DIR/gres.conf"
    job_submit_lua >"$CONF_DIR/job_submit.lua"
}

ensure_hosts() {
    # MASTER_ADDR=node1 must resolve for a rendezvous, as on a real cluster.
    local node missing=()
    for node in "${NODES[@]}"; do
        grep -Eq "^127\.0\.0\.1([[:space:]].*)?[[:space:]]$node([[:space:]]|\$)" /etc/hosts || missing+=("$node")
    done
    if ((${#missing[@]})); then
        echo "127.0.0.1 ${missing[*]}" >>/etc/hosts
    fi
}

ensure_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    runuser -u munge -- munged --force
    local i
    for ((i = 0; i < 50; i++)); do
        if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
            # Remember that munged is ours, so that stop ends it (and only then).
            cp /run/munge/munged.pid "$STATE/munged.pid"
            return 0
        fi
        sleep 0.1
    done
    die 1 "munged started but 'munge -n | unmunge' still fails; see /var/log/munge/munged.log"
}

show_logs() {
    local log
    for log in "$STATE"/log/*.log; do
        [[ -f $log ]] || continue
        echo "==> $log <=="
        tail -n 20 "$log"
    done >&2
}

# Sends SIGTERM to the daemon named by each pid file, waits, then SIGKILLs what is left.
stop_pidfiles() {
    local pidfile pids=() pid
    for pidfile in "$@"; do
        if pid_alive "$pidfile"; then
            pid=$(<"$pidfile")
            pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
    ((${#pids[@]})) || return 0
    local deadline=$((SECONDS + STOP_TIMEOUT_S)) left
    while :; do
        left=()
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && left+=("$pid")
        done
        ((${#left[@]})) || return 0
        if ((SECONDS >= deadline)); then
            kill -KILL "${left[@]}" 2>/dev/null || true
            return 0
        fi
        sleep 0.2
    done
}

start_daemons() {
    # -c: start from a clean state, so no job from an earlier run comes back.
    local node
    if ! slurmctld -c; then
        show_logs
        die 1 "slurmctld failed to start"
    fi
    for node in "${NODES[@]}"; do
        if ! slurmd -N "$node"; then
            show_logs
            die 1 "slurmd -N $node failed to start"
        fi
    done
}

wait_for_idle() {
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until cluster_healthy; do
        if ((SECONDS >= deadline)); then
            echo "slurm-cluster.sh: nodes not idle after ${START_TIMEOUT_S}s; sinfo says:" >&2
            timeout 10 sinfo -N -l >&2 || true
            show_logs
            return 1
        fi
        sleep 0.5
    done
}

on_exit() {
    if ((START_FAILED)); then
        stop_cluster >/dev/null 2>&1 || true
    fi
}

start_cluster() {
    if cluster_healthy && config_current; then
        echo "Slurm test cluster already up (${NODES[*]})."
        return 0
    fi
    # Whatever is left of an earlier run (unhealthy, or with an older config) goes first.
    stop_cluster
    START_FAILED=1
    trap on_exit EXIT
    ensure_hosts
    write_config
    ensure_munge
    start_daemons
    wait_for_idle || exit 1
    START_FAILED=0
    echo "Slurm test cluster up: ${NODES[*]}, partitions debug (default), high, gpu, side and bind."
}

stop_cluster() {
    local pidfiles=() node
    for node in "${NODES[@]}"; do
        pidfiles+=("$STATE/slurmd-$node.pid")
    done
    if pid_alive "$STATE/slurmctld.pid"; then
        # Cancel jobs first, so that no slurmstepd outlives the slurmd that started it.
        local jobs
        jobs=$(timeout 10 squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs 2>/dev/null || true
            local deadline=$((SECONDS + STOP_TIMEOUT_S))
            while ((SECONDS < deadline)) &&
                [[ -n $(timeout 10 squeue -h -o '%A' -t RUNNING,COMPLETING,SUSPENDED 2>/dev/null || true) ]]; do
                sleep 0.25
            done
        fi
    fi
    stop_pidfiles "${pidfiles[@]}"
    stop_pidfiles "$STATE/slurmctld.pid"
    if [[ -f $STATE/munged.pid ]]; then
        # Only a munged that start launched; one the system runs is left alone.
        stop_pidfiles "$STATE/munged.pid"
    fi
}

status_cluster() {
    if pid_alive "$STATE/slurmctld.pid"; then
        timeout 10 sinfo || true
    else
        echo "Slurm test cluster is not running (no live slurmctld pid in $STATE)."
    fi
    cluster_healthy
}

main() {
    case ${1:-} in
        start | stop | status) ;;
        *) die 64 "usage: $0 start|stop|status" ;;
    esac
    require_root_and_packages
    case $1 in
        start) start_cluster ;;
        stop) stop_cluster ;;
        status) status_cluster || exit 1 ;;
    esac
}

main "$@"
