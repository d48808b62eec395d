#!/usr/bin/env bash
# scripts/slurm_down.sh  -- stop the local Slurm cluster started by scripts/slurm_up.sh (one node or N nodes).
#
# Usage (as root):   scripts/slurm_down.sh
#
# Cancels every job still queued or running (the cluster is this machine's test cluster), waits for them to
# end, stops slurmctld and every slurmd with `scontrol shutdown` (then any slurmd its pid file still names:
# /run/slurmd.pid for one node, /run/slurmd-<node>.pid for each of N), then stops munged through its pid file.
# Safe to run when nothing is running (exits 0), and when the controller is already gone (falls back to the
# pid files). Logs to /var/log/slurm/slurm_down.log. Exits non-zero only if a daemon refuses to stop.
set -uo pipefail

readonly LOG_DIR=/var/log/slurm
readonly CTLD_PID=/run/slurmctld.pid
readonly MUNGE_PID=/run/munge/munged.pid

log() { echo "slurm_down: $*"; }
alive() {  # alive PIDFILE -> true when the pid file names a running (not zombie) process
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null
}

[[ $(id -u) -eq 0 ]] || { echo "slurm_down: ERROR: must run as root" >&2; exit 1; }
mkdir -p "$LOG_DIR"
exec > >(tee -a "$LOG_DIR/slurm_down.log") 2>&1
log "$(date -Is) stopping Slurm on $(hostname)"

# wait_gone PIDFILE SECONDS -> true once the process in PIDFILE has exited
wait_gone() {
  local i
  for ((i = 0; i < $2 * 2; i++)); do
    alive "$1" || return 0
    sleep 0.5
  done
  return 1
}

# stop_pid NAME PIDFILE: SIGTERM, then SIGKILL if it is still there after 15 s. Only ever the pid we recorded.
stop_pid() {
  local name=$1 pidfile=$2 pid
  alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile" 2>/dev/null) || return 0
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_gone "$pidfile" 15; then
    log "$name did not stop on SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pidfile" 5 || { log "ERROR: $name (pid $pid) is still running"; return 1; }
  fi
  rm -f "$pidfile"
}

rc=0
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q "is UP"; then
  # Jobs first: `scontrol shutdown` leaves running job steps orphaned, and a later slurm_up would resurrect
  # their records from the state save.
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [[ -n ${jobs// /} ]]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086  # word splitting is the point: one argument per job id
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 60); do
      [[ -z $(squeue -h -o %A -t PD,R,CG,S,CF 2>/dev/null) ]] && break
      sleep 1
    done
    left=$(squeue -h -o "%A %T" 2>/dev/null | tr '\n' ';')
    [[ -z $left ]] || log "WARNING: jobs still present after 60 s: $left"
  fi
  log "scontrol shutdown"
  scontrol shutdown >/dev/null 2>&1 || true
  wait_gone "$CTLD_PID" 30 || true
  for pidfile in /run/slurmd.pid /run/slurmd-*.pid; do [[ -f $pidfile ]] && { wait_gone "$pidfile" 30 || true; }; done
else
  log "slurmctld not answering; stopping whatever the pid files name"
fi
stop_pid slurmctld "$CTLD_PID" || rc=1
for pidfile in /run/slurmd.pid /run/slurmd-*.pid; do
  [[ -f $pidfile ]] || continue
  name=${pidfile#/run/}
  stop_pid "${name%.pid}" "$pidfile" || rc=1
done
stop_pid munged "$MUNGE_PID" || rc=1
rm -f /run/munge/munged.socket.2.lock

if [[ $rc == 0 ]]; then
  log "Slurm and munge are stopped"
else
  log "ERROR: some daemons did not stop (see above)"
fi
exit $rc
