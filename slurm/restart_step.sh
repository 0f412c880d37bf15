#!/usr/bin/env bash
# Run one pdserve server (an `srun` step) and restart it when a restart can help.
#
#   slurm/restart_step.sh MAX_RESTARTS COMMAND [ARGS...]
#
# Exit statuses of a server (pdserve/exit_codes.py): 0 stopped or drained after SIGTERM, 2 bad
# configuration, 3 start-up failed: final, returned as they are. Anything else — 75 (the engine
# died while serving), death by a signal, a crash — restarts the command after 1 s, at most
# MAX_RESTARTS times; then the last status is returned. SIGTERM/SIGINT are passed on to the
# running command (which drains) and end the loop.
max=${1:?usage: restart_step.sh MAX_RESTARTS COMMAND [ARGS...]}
shift
restarts=0
child=
stopping=
trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
while :; do
    "$@" &
    child=$!
    wait "$child"
    code=$?
    if [ -n "$stopping" ]; then  # wait was interrupted by the trap: collect the command's own status
        wait "$child"
        exit $?
    fi
    child=
    case $code in 0|2|3) exit "$code" ;; esac
    if [ "$restarts" -ge "$max" ]; then
        echo "pdserve: '$*' exited with status $code after $restarts restart(s); giving up" >&2
        exit "$code"
    fi
    restarts=$((restarts + 1))
    echo "pdserve: '$*' exited with status $code; restart $restarts of $max" >&2
    sleep 1
    [ -n "$stopping" ] && exit "$code"
done
