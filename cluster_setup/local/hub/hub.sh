#!/usr/bin/env bash
# JupyterHub with SlurmSpawner on the local test cluster (root; `cluster.sh up` first):
#
#   cluster_setup/local/hub/hub.sh start   render the hub's config (roles/jupyterhub, through
#                                          render.yml), install configurable-http-proxy if missing,
#                                          start the hub; log in at the URL it prints
#   cluster_setup/local/hub/hub.sh stop    stop the hub and its proxy (before `cluster.sh down`)
#
# Students are local accounts in the group slstudents, instructors in slinstructors
# (hub/inventory.yml); each one's JupyterLab runs as a Slurm job on gpu01 or gpu02, and they
# share nbgrader's exchange in $SCALINGLAB_CLUSTER_DIR/exchange (cluster_setup/README.md, section 6). Logs: $SCALINGLAB_CLUSTER_DIR/log/jupyterhub.log, and each
# job's in the student's home directory.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOCAL=$(cd "$HERE/.." && pwd)
REPO=$(cd "$LOCAL/../.." && pwd)
export SCALINGLAB_CLUSTER_DIR=${SCALINGLAB_CLUSTER_DIR:-/tmp/scalinglab-cluster}
STATE=$SCALINGLAB_CLUSTER_DIR
CONFIG=$STATE/etc/hub/jupyterhub_config.py
PIDFILE=$STATE/run/jupyterhub.pid
LOG=$STATE/log/jupyterhub.log

PROG=hub.sh
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$LOCAL/lib.sh"

# A setting from the rendered jupyterhub_config.py, e.g. `config_value c.JupyterHub.port`.
config_value() { sed -n "s/^$1 = \"\\{0,1\\}\\([^\"]*\\)\"\\{0,1\\}$/\\1/p" "$CONFIG"; }

# What the hub needs beyond the cluster: sudo (the spawner runs Slurm commands as the student)
# and npm for the proxy; the role installs the same.
install_packages() {
    local missing=()
    command -v sudo >/dev/null || missing+=(sudo)
    command -v npm >/dev/null || missing+=(nodejs npm)
    [[ ${#missing[@]} -eq 0 ]] && return
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
        --no-install-recommends "${missing[@]}" \
        >/dev/null
}

render_config() {
    render "$LOCAL/inventory.yml" "$HERE/inventory.yml" "$STATE/log/hub-render.log"
}

# The proxy's path in the config is <prefix>/<version>/node_modules/.bin/configurable-http-proxy.
install_proxy() {
    local proxy prefix
    proxy=$(sed -n 's|^ *"\(.*/node_modules/\.bin/configurable-http-proxy\)"$|\1|p' "$CONFIG")
    [[ -n $proxy ]] || die "no configurable-http-proxy command in $CONFIG"
    [[ -x $proxy ]] && return
    prefix=${proxy%/node_modules/*}
    say "installing configurable-http-proxy ${prefix##*/} into $prefix"
    npm install --no-fund --no-audit --loglevel=error --prefix "$prefix" \
        "configurable-http-proxy@${prefix##*/}" >/dev/null
}

start() {
    pid_alive "$STATE/run/slurmctld.pid" || die "the local cluster is not up: cluster.sh up first"
    if pid_alive "$PIDFILE"; then
        say "already running (pid $(cat "$PIDFILE"))"
        return
    fi
    install_packages
    render_config
    install_proxy
    local venv url deadline=$((SECONDS + 60))
    venv=$(dirname "$(dirname "$(config_value c.SlurmSpawner.batchspawner_singleuser_cmd)")")
    url="http://$(config_value c.JupyterHub.ip):$(config_value c.JupyterHub.port)"
    install -d -m 0700 "$STATE/hub"
    cd "$STATE/hub"
    # In a session of its own, so that the hub and its proxy outlive this shell.
    setsid "$venv/bin/jupyterhub" --config "$CONFIG" >"$LOG" 2>&1 &
    echo $! >"$PIDFILE"
    until curl -fs -o /dev/null "$url/hub/api/"; do
        pid_alive "$PIDFILE" || { tail -n 30 "$LOG" >&2; die "the hub exited; see $LOG"; }
        ((SECONDS < deadline)) || die "the hub did not answer at $url within 60 s; see $LOG"
        sleep 0.5
    done
    say "JupyterHub at $url/ (log: $LOG)"
}

stop() {
    # The hub stops the proxy it started; students' jobs keep running (cleanup_servers).
    if pid_alive "$PIDFILE"; then
        stop_pids 10 "$(cat "$PIDFILE")"
    fi
    if pid_alive "$STATE/hub/jupyterhub-proxy.pid"; then
        stop_pids 5 "$(cat "$STATE/hub/jupyterhub-proxy.pid")"
    fi
    rm -f "$PIDFILE"
    say "stopped"
}

[[ $(id -u) -eq 0 ]] || die "must run as root (the hub checks passwords and submits jobs as students)"
case ${1:-} in
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 start|stop" ;;
esac
