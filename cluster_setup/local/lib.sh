# shellcheck shell=bash
# What cluster.sh and hub/hub.sh share. The caller sets PROG (its name in messages) and REPO.

# shellcheck disable=SC2154  # PROG is the caller's
trap 'echo "$PROG: error: line $LINENO: $BASH_COMMAND failed" >&2' ERR

say() { echo "$PROG: $*"; }
die() { echo "$PROG: error: $*" >&2; exit 1; }

# A process that exists and is not a zombie (in a container, PID 1 may never reap them).
running() {
    local state
    state=$(sed -n 's/.*) \(.\) .*/\1/p' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]]
}
pid_alive() { [[ -s $1 ]] && running "$(cat "$1")"; }

# stop_pids SECONDS PID...: SIGTERM, then SIGKILL what still runs after SECONDS; returns once
# every one is gone.
stop_pids() {
    local deadline=$((SECONDS + $1)) pid alive
    shift
    local pids=("$@")
    [[ ${#pids[@]} -eq 0 ]] && return
    kill -TERM "${pids[@]}" 2>/dev/null || true
    while ((SECONDS < deadline)); do
        alive=()
        for pid in "${pids[@]}"; do
            running "$pid" && alive+=("$pid")
        done
        [[ ${#alive[@]} -eq 0 ]] && return
        sleep 0.2
    done
    kill -KILL "${alive[@]}" 2>/dev/null || true
    for pid in "${alive[@]}"; do
        while running "$pid"; do
            sleep 0.1
        done
    done
}

# render INVENTORY... LOG: runs render.yml (the playbook's config tasks only) with these
# inventories, using $ANSIBLE_PLAYBOOK, the repository's .venv, or ansible-playbook on PATH.
render() {
    local log=${*: -1} inventories=("${@:1:$#-1}") playbook=${ANSIBLE_PLAYBOOK:-} args=()
    if [[ -z $playbook ]]; then
        playbook=$REPO/.venv/bin/ansible-playbook
        [[ -x $playbook ]] || playbook=$(command -v ansible-playbook) ||
            die "ansible-playbook not found: run 'make cluster-tools' at the repository root, or set ANSIBLE_PLAYBOOK"
    fi
    for inventory in "${inventories[@]}"; do
        args+=(-i "$inventory")
    done
    say "rendering with $playbook"
    ANSIBLE_NOCOLOR=1 "$playbook" "${args[@]}" "$REPO/cluster_setup/ansible/render.yml" \
        >"$log" 2>&1 || { cat "$log" >&2; die "rendering failed; see $log"; }
}
