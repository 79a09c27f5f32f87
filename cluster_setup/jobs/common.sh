# shellcheck shell=bash
# Sourced by every job script, at the start of the batch step. It checks the settings and
# exports what the ranks need:
#
#   BACKEND            gloo | nccl (default: nccl when the job has GPUs, else gloo); when set,
#                      also exported as MINIDIST_BACKEND, the default of minidist.core.launch.run
#   COURSE_ENV         the course's Python environment (default /opt/scalinglab/venv)
#   COURSE_DIR         the course checkout (default /opt/scalinglab/course)
#   NETWORK_INTERFACE  optional: the interface the ranks talk over (e.g. ib0, eth1), checked on
#                      every node and exported as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
#
# and MASTER_ADDR / MASTER_PORT: the job's first node and a port derived from the job id.

die() {
    echo "error: $*" >&2
    exit 1
}

[[ -n ${SLURM_JOB_ID:-} ]] || die "run this script with sbatch, not directly"

# An explicit BACKEND also decides every minidist.core.launch.run in the job, a lab's cells included;
# left unset, each run picks nccl when it has a GPU per rank.
if [[ -n ${BACKEND:-} ]]; then
    export MINIDIST_BACKEND=$BACKEND
else
    BACKEND=$([[ -n ${SLURM_GPUS_ON_NODE:-} ]] && echo nccl || echo gloo)
fi
export BACKEND
export COURSE_ENV=${COURSE_ENV:-/opt/scalinglab/venv}
export COURSE_DIR=${COURSE_DIR:-/opt/scalinglab/course}
export JOBS_DIR=$COURSE_DIR/cluster_setup/jobs
PYTHON=$COURSE_ENV/bin/python

case $BACKEND in
    gloo | nccl) ;;
    *) die "BACKEND=$BACKEND: use BACKEND=gloo (CPU) or BACKEND=nccl (GPUs)" ;;
esac
[[ -x $PYTHON ]] || die "COURSE_ENV=$COURSE_ENV has no bin/python: set COURSE_ENV to the course's venv"
[[ -d $JOBS_DIR ]] || die "COURSE_DIR=$COURSE_DIR has no cluster_setup/jobs: set COURSE_DIR to the course checkout"
if [[ $BACKEND == nccl && -z ${SLURM_GPUS_ON_NODE:-} ]]; then
    die "BACKEND=nccl needs GPUs: submit with --gpus-per-node=N (or use BACKEND=gloo)"
fi
export PATH=$COURSE_ENV/bin:$PATH

# The address slurm.conf gives a node (NodeAddr): hostnames of compute nodes need not resolve.
node_addr() {
    scontrol show node "$1" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p'
}
export -f node_addr  # for `srun bash -c` steps

mapfile -t JOB_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=$(node_addr "${JOB_NODES[0]}")
export MASTER_ADDR
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 40000))

# One task per node looks for the interface; a missing one fails the job now, not as a
# rendezvous timeout minutes later.
if [[ -n ${NETWORK_INTERFACE:-} ]]; then
    # shellcheck disable=SC2016  # expanded on each node
    if ! srun --nodes="${#JOB_NODES[@]}" --ntasks="${#JOB_NODES[@]}" --ntasks-per-node=1 \
        --kill-on-bad-exit=0 bash -c '
            names=$(sed -n "s/^ *\([^:]*\):.*/\1/p" /proc/net/dev | sort | tr "\n" " ")
            for name in $names; do
                [[ $name == "$1" ]] && exit 0
            done
            echo "error: NETWORK_INTERFACE=$1 does not exist on node $SLURMD_NODENAME" \
                "(its interfaces: ${names% })" >&2
            exit 1' _ "$NETWORK_INTERFACE"; then
        die "NETWORK_INTERFACE=$NETWORK_INTERFACE is missing on some node (see above): set it to an interface every node has, or unset it"
    fi
    export GLOO_SOCKET_IFNAME=$NETWORK_INTERFACE NCCL_SOCKET_IFNAME=$NETWORK_INTERFACE
fi

echo "job $SLURM_JOB_ID: ${#JOB_NODES[@]} node(s) ${JOB_NODES[*]}, BACKEND=$BACKEND," \
    "MASTER_ADDR=$MASTER_ADDR, NETWORK_INTERFACE=${NETWORK_INTERFACE:-(default)}"
