# shellcheck shell=bash
# Source in a shell (any user) to use the local cluster that cluster.sh started:
#   source cluster_setup/local/env.sh
#   BACKEND=gloo sbatch --wait "$COURSE_DIR/cluster_setup/jobs/srun_ranks.sbatch"
# Sourced, so no `set -e` here: it would change the caller's shell.
_scalinglab_local=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SCALINGLAB_CLUSTER_DIR=${SCALINGLAB_CLUSTER_DIR:-/tmp/scalinglab-cluster}
export SLURM_CONF=$SCALINGLAB_CLUSTER_DIR/etc/head/slurm.conf
# The job scripts' checkout and environment: this repository and its .venv.
COURSE_DIR=$(cd "$_scalinglab_local/../.." && pwd)
export COURSE_DIR
export COURSE_ENV=$COURSE_DIR/.venv
# Each node's interface inside its namespace (gloo/NCCL would otherwise pick by hostname).
export NETWORK_INTERFACE=sl0
unset _scalinglab_local
