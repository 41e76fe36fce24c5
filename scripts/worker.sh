#!/usr/bin/env bash
# eaglet's Prefect worker as a service: started detached, stopped by one SIGTERM.
#
#   scripts/worker.sh start [ARGS]   # `prefect worker start --pool eaglet ARGS` in its own session, detached;
#                                    # its pid and log in $EAGLET_WORKER_DIR (default ~/.eaglet/worker)
#   scripts/worker.sh stop           # one SIGTERM; waits until it has exited (at most $EAGLET_WORKER_STOP_S, 90)
#   scripts/worker.sh status         # running or not, its pid and log
#   scripts/worker.sh run [ARGS]     # in the foreground (a systemd unit's ExecStart, a container's command)
#
# Why a script: `prefect worker start` turns its first SIGTERM into a SIGINT to itself, and a process started
# in the background of a non-interactive shell (`setsid prefect worker start &` in a script, nohup, cron) inherits
# SIGINT ignored, so that SIGINT does nothing and only a second SIGTERM (a SIGKILL) stops it. This script starts
# the worker with SIGINT back at its default, so one SIGTERM stops it gracefully: it takes no new run and exits
# (under a second here with nothing running). Flow runs in flight are separate processes and keep running.
# PYTHON (default: this checkout's .venv/bin/python) is the interpreter with the controller installed; the
# Prefect settings (PREFECT_API_URL, PREFECT_HOME) come from the environment as for any prefect command.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$here/.venv/bin/python}"
dir="${EAGLET_WORKER_DIR:-$HOME/.eaglet/worker}"
pidfile="$dir/worker.pid" logfile="$dir/worker.log"
# SIGINT back to its default before prefect starts (bash cannot undo a signal ignored at its own start; exec can),
# in a session of its own (no terminal's signals; a process already leading its group keeps it)
launch=(-c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
try:
    os.setsid()
except PermissionError:
    pass
os.execv(sys.executable, [sys.executable, "-m", "prefect", "worker", "start", *sys.argv[1:]])')

running() { [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

with_pool() {  # the pool prefect.yaml names unless ARGS name one
  case " $* " in *" --pool "* | *" -p "*) printf '%s\n' "$@" ;; *) printf '%s\n' --pool eaglet "$@" ;; esac
}

case "${1:-}" in
start)
  shift
  if running; then
    echo "worker: already running (pid $(cat "$pidfile"), log $logfile)" >&2
    exit 1
  fi
  mkdir -p "$dir"
  mapfile -t args < <(with_pool "$@")
  cd "$here" || exit 1
  "$PY" "${launch[@]}" "${args[@]}" >>"$logfile" 2>&1 </dev/null &
  echo $! >"$pidfile"
  sleep 1
  if ! running; then
    echo "worker: exited at once; the end of $logfile:" >&2
    tail -n 20 "$logfile" >&2
    exit 1
  fi
  echo "worker: started (pid $(cat "$pidfile"), log $logfile)"
  ;;
stop)
  if ! running; then
    echo "worker: not running"
    rm -f "$pidfile"
    exit 0
  fi
  pid="$(cat "$pidfile")" limit="${EAGLET_WORKER_STOP_S:-90}" t0=$SECONDS
  kill -TERM "$pid"
  while kill -0 "$pid" 2>/dev/null; do
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      echo "worker: pid $pid still running ${limit} s after one SIGTERM (a second SIGTERM kills it: kill $pid)" >&2
      exit 1
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
  echo "worker: stopped (pid $pid) $((SECONDS - t0)) s after one SIGTERM"
  ;;
status)
  if running; then echo "worker: running (pid $(cat "$pidfile"), log $logfile)"; else echo "worker: not running"; exit 3; fi
  ;;
run)
  shift
  mapfile -t args < <(with_pool "$@")
  cd "$here" || exit 1
  exec "$PY" "${launch[@]}" "${args[@]}"
  ;;
*)
  echo "usage: scripts/worker.sh start|stop|status|run [prefect worker start options]" >&2
  exit 2
  ;;
esac
