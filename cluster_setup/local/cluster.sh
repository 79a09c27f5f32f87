#!/usr/bin/env bash
# A real Slurm cluster on one machine, for trying the course's cluster setup (root only):
#
#   cluster_setup/local/cluster.sh up       munge, slurmctld and two slurmd "nodes" (gpu01, gpu02),
#                                           each node in its own network namespace on bridge slbr0
#   cluster_setup/local/cluster.sh status   are the daemons up, and what does sinfo say
#   cluster_setup/local/cluster.sh shape RATE [NODE=RATE ...]
#                                           shape every node's link to the others to RATE each
#                                           way (tc rates: 400mbit, 50mbps), a NODE's to its own
#   cluster_setup/local/cluster.sh shape off   back to unshaped links
#   cluster_setup/local/cluster.sh down     stop everything and remove what `up` made
#
# Then, in any shell (any user): source cluster_setup/local/env.sh; sbatch/srun/squeue work.
# The configuration comes from the Ansible templates (roles/slurm), rendered by render.yml with
# local/inventory.yml; node names and addresses are read back from the rendered slurm.conf.
# State lives in $SCALINGLAB_CLUSTER_DIR (default /tmp/scalinglab-cluster).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export SCALINGLAB_CLUSTER_DIR=${SCALINGLAB_CLUSTER_DIR:-/tmp/scalinglab-cluster}
STATE=$SCALINGLAB_CLUSTER_DIR
MARKER=$STATE/.scalinglab-cluster  # `down` only deletes a directory that `up` made
CONF=$STATE/etc/head/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket
BRIDGE=slbr0
NODE_IF=sl0  # each node's interface inside its namespace
PREFIX_LEN=24
PACKAGES=(slurmctld slurmd slurm-client munge iproute2)

PROG=cluster.sh
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$HERE/lib.sh"

# Node names and addresses, and the controller's address, as the rendered slurm.conf has them.
nodes() { sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$CONF"; }
node_addr() { sed -n "s/^NodeName=$1 NodeAddr=\\([^ ]*\\) .*/\\1/p" "$CONF"; }
head_addr() { sed -n 's/^SlurmctldHost=[^(]*(\([^)]*\))$/\1/p' "$CONF"; }

install_packages() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$pkg")
    done
    [[ ${#missing[@]} -eq 0 ]] && return
    say "installing ${missing[*]}"
    # Wait for a dpkg lock another installer holds (the test suite installs Chromium too).
    local apt=(apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}")
    # A fresh machine (a CI container) may have no package lists yet.
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" >/dev/null 2>&1 ||
        { apt-get -o DPkg::Lock::Timeout=300 update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" >/dev/null; }
}

make_state_dir() {
    # World-readable (not writable): ordinary users read slurm.conf and reach munge's socket.
    install -d -m 0755 "$STATE" "$STATE"/{etc,munge,ctld,spool,log,run,dev}
    touch "$MARKER"
}

start_munge() {
    if [[ ! -s $STATE/munge/munge.key ]]; then
        (umask 077 && head -c 1024 /dev/urandom >"$STATE/munge/munge.key")
    fi
    # --force: munged refuses to run as root otherwise; this key and socket are ours alone.
    munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/log/munged.log" \
        --seed-file="$STATE/munge/munged.seed"
}

# slurm.conf, gres.conf and cgroup.conf, one directory per host.
render_configs() {
    render "$HERE/inventory.yml" "$STATE/log/render.log"
}

make_network() {
    local addr node veth
    addr=$(head_addr)
    ip link add "$BRIDGE" type bridge
    ip addr add "$addr/$PREFIX_LEN" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for node in $(nodes); do
        veth=slv-$node
        ip netns add "sl-$node"
        ip link add "$veth" type veth peer name "$NODE_IF" netns "sl-$node"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "sl-$node" addr add "$(node_addr "$node")/$PREFIX_LEN" dev "$NODE_IF"
        ip -n "sl-$node" link set "$NODE_IF" up
        ip -n "sl-$node" link set lo up
    done
}

make_fake_gpus() {
    # slurmd wants the files that gres.conf names to be devices: these are copies of /dev/null
    # (char 1:3), so opening one is harmless. Jobs get CUDA_VISIBLE_DEVICES as with real GPUs.
    local line node files i
    while read -r line; do
        node=$(sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' <<<"$line")
        files=$(sed -n 's/.* File=\([^ ]*\).*/\1/p' <<<"$line")
        local dir=${files%/*} base=${files##*/}
        local stem=${base%%\[*} range=${base#*\[}
        range=${range%\]}
        [[ $dir == "$STATE"/* ]] || die "gres.conf names $dir for $node, outside $STATE"
        install -d -m 0755 "$dir"
        for i in $(seq "${range%-*}" "${range#*-}"); do
            [[ -e $dir/$stem$i ]] || mknod -m 0666 "$dir/$stem$i" c 1 3
        done
    done < <(grep '^NodeName=.* File=' "$STATE/etc/head/gres.conf")
}

start_slurm() {
    slurmctld -f "$CONF"
    for node in $(nodes); do
        install -d -m 0755 "$STATE/spool/$node"
        # nsenter, not `ip netns exec`: that one also remounts /sys, hiding the cgroup mounts
        # slurmd needs.
        nsenter --net="/run/netns/sl-$node" slurmd -f "$STATE/etc/$node/slurm.conf" -N "$node"
    done
}

wait_for_idle_nodes() {
    local deadline=$((SECONDS + 60)) states node
    export SLURM_CONF=$CONF
    while ((SECONDS < deadline)); do
        if ! is_up; then
            tail -n 5 "$STATE/log/slurmctld.log" >&2
            die "slurmctld exited; its log is $STATE/log/slurmctld.log"
        fi
        for node in $(nodes); do
            if [[ -e $STATE/run/slurmd-$node.pid ]] && ! pid_alive "$STATE/run/slurmd-$node.pid"; then
                tail -n 5 "$STATE/log/slurmd-$node.log" >&2
                die "slurmd on $node exited; its log is $STATE/log/slurmd-$node.log"
            fi
        done
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
        if [[ -n $states ]] && ! grep -qv ' idle$' <<<"$states"; then
            say "up: $(tr '\n' ' ' <<<"$states")"
            return
        fi
        sleep 0.5
    done
    die "nodes not idle after 60 s: ${states:-no answer from slurmctld}; see $STATE/log"
}

is_up() { pid_alive "$STATE/run/slurmctld.pid"; }

up() {
    if is_up; then
        say "already up (state in $STATE); 'cluster.sh down' first to restart"
        status
        return
    fi
    # A half-made cluster (an earlier `up` that failed) is cleared first.
    if [[ -e $MARKER ]] || ip link show "$BRIDGE" >/dev/null 2>&1; then
        down
    fi
    install_packages
    make_state_dir
    start_munge
    render_configs
    make_network
    make_fake_gpus
    start_slurm
    wait_for_idle_nodes
    say "use it from any shell: source $HERE/env.sh"
}

# stop_pids GRACE PID...: SIGTERM, then SIGKILL to those still running after GRACE seconds.
down() {
    local ns link pids=()
    # A hub started by hub/hub.sh spawns its servers through this cluster: it goes first.
    if pid_alive "$STATE/run/jupyterhub.pid"; then
        "$HERE/hub/hub.sh" stop
    fi
    # The controller first (it shuts down quickly while its nodes still answer), then every
    # process in a node's namespace (slurmd, job steps, what users started), then munge.
    if pid_alive "$STATE/run/slurmctld.pid"; then
        stop_pids 5 "$(cat "$STATE/run/slurmctld.pid")"
    fi
    for ns in $(ip netns list | sed -n 's/^\(sl-[^ ]*\).*/\1/p'); do
        mapfile -t -O "${#pids[@]}" pids < <(ip netns pids "$ns")
    done
    stop_pids 2 "${pids[@]}"
    if pid_alive "$STATE/munge/munged.pid"; then
        stop_pids 5 "$(cat "$STATE/munge/munged.pid")"
    fi
    # Deleting one end of a veth pair deletes both; a namespace's deletion would do it too, but
    # only some time later.
    for link in $(ip -o link show | sed -n 's/^[0-9]*: \(slv-[^@:]*\).*/\1/p'); do
        ip link delete "$link"
    done
    for ns in $(ip netns list | sed -n 's/^\(sl-[^ ]*\).*/\1/p'); do
        ip netns delete "$ns"
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link delete "$BRIDGE"
    fi
    if [[ -e $MARKER ]]; then
        rm -rf "$STATE"
    elif [[ -e $STATE ]]; then
        say "left $STATE in place: not made by cluster.sh"
    fi
    say "down"
}

# Ranks of one node talk over its loopback; ranks of two nodes over the two nodes' veths and the
# bridge. A token bucket on both ends of a node's veth (its egress inside the namespace, the
# bridge's egress towards it) shapes everything that node sends and receives, so a pair of
# nodes goes at the slower of their two rates, as a cluster goes at its slowest link.
shape() {
    is_up || die "the cluster is down: run 'cluster.sh up' first"
    [[ $# -ge 1 ]] || die "usage: cluster.sh shape RATE [NODE=RATE ...] (e.g. shape 400mbit gpu02=200mbit), or shape off"
    local node spec rate
    local -A rates=()
    for node in $(nodes); do
        rates[$node]=$1
    done
    shift
    for spec in "$@"; do
        node=${spec%%=*}
        [[ $spec == *=?* && -n ${rates[$node]+set} ]] ||
            die "shape: '$spec' should be NODE=RATE for a node of this cluster ($(nodes | tr '\n' ' ' | sed 's/ $//'))"
        rates[$node]=${spec#*=}
    done
    for node in $(nodes); do
        rate=${rates[$node]}
        if [[ $rate == off ]]; then
            tc qdisc del dev "slv-$node" root 2>/dev/null || true
            tc -n "sl-$node" qdisc del dev "$NODE_IF" root 2>/dev/null || true
            continue
        fi
        # The burst holds a whole 64 KiB segment (veths pass them unsplit); the queue waits up
        # to 1 s rather than dropping, as a slow link does.
        if ! tc qdisc replace dev "slv-$node" root tbf rate "$rate" burst 256kb latency 1s 2>/dev/null ||
            ! tc -n "sl-$node" qdisc replace dev "$NODE_IF" root tbf rate "$rate" burst 256kb latency 1s; then
            die "shape: tc refused rate '$rate' for $node; give a tc rate such as 400mbit or 50mbps"
        fi
    done
    say "links between nodes: $(for node in $(nodes); do printf '%s %s, ' "$node" "${rates[$node]}"; done | sed 's/, $//') (each way)"
}

status() {
    if ! is_up; then
        say "down"
        return 3
    fi
    say "slurmctld pid $(cat "$STATE/run/slurmctld.pid"), state in $STATE"
    SLURM_CONF=$CONF sinfo -N -o '%N %T %G %c %m'
}

[[ $(id -u) -eq 0 ]] || die "must run as root (it starts daemons and makes network namespaces)"
case ${1:-} in
    up) up ;;
    down) down ;;
    status) status || exit "$?" ;;
    shape) shift && shape "$@" ;;
    *) die "usage: $0 up|down|status|shape RATE [NODE=RATE ...]|shape off" ;;
esac
