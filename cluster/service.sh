#!/usr/bin/env bash
# `specdec serve --address auto` as a background service on the Ray head node.
#
#   service.sh start [SERVE FLAGS...]    start it detached (setsid + nohup): it outlives the SSH session,
#                                        and a supervisor restarts it when it dies (after
#                                        $SPECDEC_RESTART_DELAY_S, 5 s) while Ray runs here, until `stop`
#   service.sh stop                      the supervisor first, then SIGTERM (running requests get
#                                        router.grace_s), SIGKILL after 90 s (10 s if it is not serving yet)
#   service.sh restart [SERVE FLAGS...]
#   service.sh status [--wait SECONDS]   the process and the gRPC health of $SPECDEC_SERVER (127.0.0.1:50051;
#                                        TLS / token flags for it in $SPECDEC_HEALTH_ARGS)
#
# The cluster files' head_start_ray_commands run `stop` before `ray stop` and `start` after
# `ray start --head`; from your machine: ray exec CLUSTER.yaml '~/specdec/cluster/service.sh status'.
# State: ~/.specdec/serve.pid, supervisor.pid, serve.log ($SPECDEC_STATE_DIR).
# tests/unit/test_service_supervisor.py kills a running `specdec serve` and sees it come back.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/env.sh"

state="${SPECDEC_STATE_DIR:-$HOME/.specdec}"
pidfile="$state/serve.pid"
logfile="$state/serve.log"
suppidfile="$state/supervisor.pid"
stopfile="$state/stopping"       # `stop` leaves it: the supervisor restarts nothing once it exists
exitsfile="$state/serve.exits"   # one line per exit of `specdec serve` since `start`
server="${SPECDEC_SERVER:-127.0.0.1:50051}"

running() {  # the pid file names a live `specdec serve` (not a recycled pid)
    local pid
    pid="$(cat "$pidfile" 2>/dev/null)" || return 1
    [ -n "$pid" ] && grep -qa specdec "/proc/$pid/cmdline" 2>/dev/null
}

supervising() {  # the supervisor's pid file names a live supervisor of this script
    local pid
    pid="$(cat "$suppidfile" 2>/dev/null)" || return 1
    [ -n "$pid" ] && grep -qa _supervise "/proc/$pid/cmdline" 2>/dev/null
}

ray_here() {  # Ray runs on this node: `ray start` wrote its address file, `ray stop` removes it
    local tmp="${RAY_TMPDIR:-${TMPDIR:-/tmp}}"
    [ -e "$tmp/ray/ray_current_cluster" ]
}

# Detached (start): run `specdec serve`, again whenever it exits, until `stop`, or until Ray is gone
# from this node (`ray stop`, `ray down`: a router without its head has nothing to serve).
supervise() {
    echo $$ >"$suppidfile"
    while [ ! -e "$stopfile" ]; do
        bash -c 'echo $$ >"$0"; exec specdec serve "$@"' "$pidfile" "$@" </dev/null || true
        echo "$(date -Is) exit" >>"$exitsfile"
        [ -e "$stopfile" ] && break
        if ! ray_here; then
            echo "=== $(date -Is) specdec serve exited and Ray is not running here: not restarting it"
            break
        fi
        echo "=== $(date -Is) specdec serve exited; restarting in ${SPECDEC_RESTART_DELAY_S:-5} s"
        sleep "${SPECDEC_RESTART_DELAY_S:-5}"
    done
    rm -f "$suppidfile"
}

start() {
    if running || supervising; then
        echo "specdec serve is already running (pid $(cat "$pidfile" 2>/dev/null)); use restart" >&2
        return 1
    fi
    mkdir -p "$state"
    rm -f "$pidfile" "$stopfile" "$exitsfile"
    echo "=== $(date -Is) specdec serve --address auto $*" >>"$logfile"
    # Once `ray down` has stopped Ray, the router exits after 15 s without the GCS (Ray's default: 60).
    RAY_gcs_rpc_server_reconnect_timeout_s="${RAY_gcs_rpc_server_reconnect_timeout_s:-15}" \
        setsid nohup bash "$here/service.sh" _supervise --address auto "$@" </dev/null >>"$logfile" 2>&1 &
    sleep 3  # a bad flag or config, or no Ray here, ends it by now
    if [ -s "$exitsfile" ] || ! running; then
        touch "$stopfile"  # no restarts of a service that cannot start
        echo "specdec serve exited at once; the end of $logfile:" >&2
        tail -n 20 "$logfile" >&2
        return 1
    fi
    echo "specdec serve started (pid $(cat "$pidfile"), log $logfile); it serves once its workers are placed:"
    echo "  $0 status --wait 900"
}

stop() {
    mkdir -p "$state"
    touch "$stopfile"
    if supervising; then
        kill -TERM "$(cat "$suppidfile")" 2>/dev/null || true
        rm -f "$suppidfile"
    fi
    if ! running; then
        rm -f "$pidfile"
        echo "specdec serve is not running"
        return 0
    fi
    local pid wait_s=90
    pid="$(cat "$pidfile")"
    # A router that is not serving yet has no requests to finish (and `specdec serve` goes on
    # waiting for its workers after SIGTERM): 10 s, then SIGKILL.
    [ "$(health)" = SERVING ] || wait_s=10
    kill -TERM "$pid"
    for _ in $(seq 1 "$wait_s"); do
        if ! running; then
            rm -f "$pidfile"
            echo "specdec serve (pid $pid) stopped"
            return 0
        fi
        sleep 1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    echo "specdec serve (pid $pid) killed: still running $wait_s s after SIGTERM" >&2
}

health() {  # grpc.health.v1 status of the router, or the gRPC error code (UNAVAILABLE: not listening)
    # With TLS or a token on health, say how in ~/.specdec/env, e.g. SPECDEC_HEALTH_ARGS="--ca
    # $HOME/.specdec/tls/ca.crt --server-name <name in the certificate>" (python -m specdec.rpc.health_probe -h).
    # shellcheck disable=SC2086  # several flags in one variable
    python -m specdec.rpc.health_probe --address "$server" ${SPECDEC_HEALTH_ARGS:-} || true
}

status() {
    local wait_s=0 state_now
    if [ "${1:-}" = "--wait" ]; then
        wait_s="${2:?--wait needs a number of seconds}"
    fi
    local deadline=$((SECONDS + wait_s))
    while :; do
        if running; then
            state_now="$(health)"
            if [ "$state_now" = SERVING ]; then
                echo "specdec serve (pid $(cat "$pidfile")): $server SERVING"
                return 0
            fi
        else
            state_now="not running"
        fi
        [ "$SECONDS" -lt "$deadline" ] || break
        sleep 2
    done
    echo "specdec serve: $server $state_now; the end of $logfile:" >&2
    tail -n 20 "$logfile" >&2 2>/dev/null || true
    return 1
}

cmd="${1:-}"
shift || true
case "$cmd" in
    start) start "$@" ;;
    stop) stop ;;
    restart) stop && start "$@" ;;
    status) status "$@" ;;
    _supervise) supervise "$@" ;;
    *)
        echo "usage: $0 start [SERVE FLAGS...] | stop | restart [SERVE FLAGS...] | status [--wait SECONDS]" >&2
        exit 2
        ;;
esac
