#!/usr/bin/env bash
# A real two-node Slurm cluster on one machine, in network namespaces of its own.
#
#   scripts/slurm_cluster.sh check [--rate 100mbit] [sbatch-options] SBATCH [script-args]
#       up -> submit (sbatch, then poll) -> print the job's output -> down; exits with the job's code
#   scripts/slurm_cluster.sh up [--rate 100mbit]      prints the cluster folder (DIR)
#   scripts/slurm_cluster.sh submit --dir DIR [sbatch-options] SBATCH [script-args]
#   scripts/slurm_cluster.sh shape --dir DIR RATE|off  rate limit on both nodes' links (tc tbf)
#   scripts/slurm_cluster.sh down --dir DIR
#   scripts/slurm_cluster.sh fanout [--rate 100mbit]
#       three nodes: the trainer on n1, engine replicas on n2 and n3; only n1's link is shaped (the
#       trainer-to-rollout link), n2<->n3 is not; recipes/slurm/fanout.sbatch at R = 1, 2, 4
#       (FANOUT_REPLICAS), direct then relay; writes runs/slurm-fanout/summary.json
#
# Layout: namespace "ctl" runs slurmctld (10.77.0.1) and holds the bridge; namespaces "n1"
# (10.77.0.11) and "n2" (10.77.0.12) each run one slurmd with its own hostname, joined to the
# bridge by a veth pair.  Nothing is attached to the host's network.  One munged (own key and
# socket) serves all three.  Every state/spool/pid/log path lives in DIR; `down` ends the
# recorded PIDs and every process left in the namespaces, deletes the namespaces and DIR.
# Jobs run as root on the host's filesystem (shared by both nodes); sbatch runs in "ctl" with
# the working directory of the caller, so $SLURM_SUBMIT_DIR is the repository.
#
# Needs root, ip/unshare/nsenter/setpriv, and Debian's slurm-wlm + munge (installed with
# apt-get when missing).  Exit codes: 0 ok, 77 skipped (the reason on stderr, starting with
# "skipped:"), 124 job timed out (JOB_TIMEOUT seconds, default 1800), else the job's exit code.
# Environment: DCR_SLURM_DIR (default for --dir), NODE_CPUS (CPUs each node offers, 16),
# SLURM_TMP (parent of DIR, default $TMPDIR or /tmp).
set -euo pipefail

SKIP=77
SUBNET=10.77.0
NODES=(n1 n2)                                      # `fanout`: n1 n2 n3
log() { echo "[slurm-cluster] $*" >&2; }
skip() { echo "skipped: $*" >&2; exit "$SKIP"; }
die() { echo "error: $*" >&2; exit 1; }

# ---------------------------------------------------------------- prerequisites
apt_install() {
  local aptlog; aptlog="$(mktemp)"
  export DEBIAN_FRONTEND=noninteractive
  if ! timeout 600 apt-get install -y -q --no-install-recommends "$@" >"$aptlog" 2>&1; then
    timeout 300 apt-get update -q >>"$aptlog" 2>&1 \
      || { rm -f "$aptlog"; skip "apt-get update failed (no package access)"; }
    timeout 600 apt-get install -y -q --no-install-recommends "$@" >>"$aptlog" 2>&1 \
      || { tail -n 5 "$aptlog" >&2; rm -f "$aptlog"; skip "apt-get install $* failed"; }
  fi
  rm -f "$aptlog"
}

require_host() {
  [ "$(id -u)" -eq 0 ] || skip "needs root (network namespaces, slurmd as root)"
  local want=() tool
  command -v ip >/dev/null || want+=(iproute2)
  for tool in slurmctld slurmd sbatch; do command -v "$tool" >/dev/null || { want+=(slurm-wlm); break; }; done
  command -v munged >/dev/null || want+=(munge)
  if [ "${#want[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || skip "${want[*]} missing and no apt-get to install them"
    log "installing ${want[*]} with apt-get"
    local t0=$SECONDS
    apt_install "${want[@]}"
    log "installed in $((SECONDS - t0)) s"
  fi
  for tool in ip tc unshare nsenter setpriv; do
    command -v "$tool" >/dev/null || skip "'$tool' not found"
  done
  local probe="dcrprobe$$"
  ip netns add "$probe" 2>/dev/null || skip "cannot create network namespaces (ip netns add)"
  ip netns del "$probe"
  unshare --uts --mount sh -c 'hostname dcrprobe && mount --bind /etc/hosts /etc/hosts' 2>/dev/null \
    || skip "cannot give a daemon its own hostname and /etc/hosts (unshare --uts --mount)"
}

# ---------------------------------------------------------------- state
load_state() {
  [ -n "${DIR:-}" ] || DIR="${DCR_SLURM_DIR:-}"
  [ -n "$DIR" ] || die "no cluster folder: pass --dir DIR or set DCR_SLURM_DIR"
  [ -f "$DIR/cluster.env" ] || die "$DIR/cluster.env not found: not a cluster folder made by 'up'"
  # shellcheck disable=SC1091
  source "$DIR/cluster.env"
}

ns_of() { echo "dcr${ID}$1"; }                     # namespace name of ctl / n1 / n2
in_ns() { local ns="$1"; shift; nsenter --net="/run/netns/$ns" "$@"; }
in_ctl() { in_ns "$(ns_of ctl)" env SLURM_CONF="$DIR/slurm.conf" "$@"; }

# PID and the command it runs; a launcher that has not exec'd it yet counts as the same.
record_pid() { echo "$1 $2" >>"$DIR/pids"; }
is_ours() {                                        # PID still runs NAME (or its launcher)?
  local comm; comm="$(cat "/proc/$1/comm" 2>/dev/null)" || return 1
  case "$comm" in "$2"|setpriv|unshare|nsenter|sh) return 0 ;; *) return 1 ;; esac
}

# ---------------------------------------------------------------- network
make_network() {
  local ctl; ctl="$(ns_of ctl)"
  ip netns add "$ctl"
  echo "$ctl" >>"$DIR/netns"
  ip -n "$ctl" link set lo up
  ip -n "$ctl" link add br0 type bridge
  ip -n "$ctl" addr add "$SUBNET.1/24" dev br0
  ip -n "$ctl" link set br0 up
  local i node ns
  for i in "${!NODES[@]}"; do
    node="${NODES[$i]}"; ns="$(ns_of "$node")"
    ip netns add "$ns"
    echo "$ns" >>"$DIR/netns"
    ip -n "$ctl" link add "v$node" type veth peer name eth0 netns "$ns"
    ip -n "$ctl" link set "v$node" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$SUBNET.$((11 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

write_hosts() {
  {
    echo "127.0.0.1 localhost"
    echo "$SUBNET.1 ctl"
    local i
    for i in "${!NODES[@]}"; do echo "$SUBNET.$((11 + i)) ${NODES[$i]}"; done
  } >"$DIR/hosts"
}

# ---------------------------------------------------------------- munge
start_munge() {
  local m="$DIR/munge"
  mkdir -p "$m"
  dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
  chown -R munge:munge "$m"
  chmod 711 "$m"; chmod 400 "$m/munge.key"
  setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F \
    --socket="$m/munge.socket" --key-file="$m/munge.key" --pid-file="$m/munged.pid" \
    --log-file="$m/munged.log" --seed-file="$m/munged.seed" >>"$DIR/log/munged.out" 2>&1 &
  record_pid $! munged
  local _
  for _ in $(seq 50); do [ -S "$m/munge.socket" ] && return 0; sleep 0.1; done
  die "munged did not create its socket (see $m/munged.log)"
}

# ---------------------------------------------------------------- slurm
write_slurm_conf() {
  local cpus="${NODE_CPUS:-16}" i
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=dcr
SlurmctldHost=ctl($SUBNET.1)
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
EOF
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeAddr=$SUBNET.$((11 + i)) CPUs=$cpus State=UNKNOWN" >>"$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" \
    >>"$DIR/slurm.conf"
}

# Start DAEMON in namespace NS with its own hostname and our /etc/hosts.  `ip netns exec`
# would remount /sys, and slurmd then fails to find its cgroup filesystem; nsenter does not.
start_in_ns() {
  local ns="$1" host="$2"; shift 2
  SLURM_CONF="$DIR/slurm.conf" unshare --uts --mount nsenter --net="/run/netns/$ns" \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' \
    "$DIR/hosts" "$host" "$@" >>"$DIR/log/$host.out" 2>&1 &
  record_pid $! "$(basename "$1")"
}

start_slurm() {
  mkdir -p "$DIR/state" "$DIR/run"
  start_in_ns "$(ns_of ctl)" ctl /usr/sbin/slurmctld -D -i
  local node
  for node in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$node"
    start_in_ns "$(ns_of "$node")" "$node" /usr/sbin/slurmd -D -N "$node"
  done
}

wait_idle() {
  local out="" deadline=$((SECONDS + 30))
  while [ "$SECONDS" -lt "$deadline" ]; do
    out="$(in_ctl timeout 5 sinfo -h -N -o '%N=%T' 2>/dev/null | sort -u)" || out=""
    if [ "$(grep -c '=idle$' <<<"$out")" -eq "${#NODES[@]}" ]; then
      log "nodes idle: $(echo $out)"; return 0
    fi
    sleep 0.25
  done
  die "nodes not idle after 30 s (states: $(echo ${out:-none})); logs in $DIR/log"
}

# ---------------------------------------------------------------- link shaping
shape() {                                          # RATE [NODE...] (default: every node)
  local rate="$1" node ns; shift
  local which=("$@"); [ "${#which[@]}" -gt 0 ] || which=("${NODES[@]}")
  for node in "${which[@]}"; do
    ns="$(ns_of "$node")"
    if [ "$rate" = off ]; then
      in_ns "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    elif ! in_ns "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 256kb latency 100ms \
        2>"$DIR/log/tc.err"; then
      skip "cannot shape the link with tc tbf: $(cat "$DIR/log/tc.err")"
    fi
  done
  log "link rate: $rate (egress of ${which[*]})"
}

# ---------------------------------------------------------------- up / down
do_up() {
  local rate="${1:-}"
  require_host
  local parent="${SLURM_TMP:-${TMPDIR:-/tmp}}"
  DIR="$(mktemp -d "$parent/dcr-slurm.XXXXXX")"
  chmod 755 "$DIR"                                # munged (user munge) must reach its folder
  setpriv --reuid=munge --regid=munge --clear-groups test -x "$DIR" \
    || { rm -rf "$DIR"; die "user munge cannot reach $DIR: set SLURM_TMP to a folder it can"; }
  ID="${DIR##*.}"
  mkdir -p "$DIR/log"
  printf 'ID=%s\nDIR=%s\nNODES=(%s)\n' "$ID" "$DIR" "${NODES[*]}" >"$DIR/cluster.env"
  trap teardown EXIT
  trap 'exit 130' INT TERM
  local t0=$SECONDS
  make_network
  write_hosts
  start_munge
  write_slurm_conf
  start_slurm
  wait_idle
  [ -z "$rate" ] || shape "$rate"
  log "up in $((SECONDS - t0)) s: $DIR"
}

ns_pids() {                                        # every process in our namespaces
  [ -f "$DIR/netns" ] || return 0
  local ns
  while read -r ns; do ip netns pids "$ns" 2>/dev/null || true; done <"$DIR/netns"
}

alive() {
  local pid name n=0
  [ -f "$DIR/pids" ] && while read -r pid name; do
    if is_ours "$pid" "$name"; then n=$((n + 1)); fi
  done <"$DIR/pids"
  echo $((n + $(ns_pids | wc -l)))
}

signal_all() {
  local sig="$1" pid name
  [ -f "$DIR/pids" ] && while read -r pid name; do
    if is_ours "$pid" "$name"; then kill "-$sig" "$pid" 2>/dev/null || true; fi
  done <"$DIR/pids"
  for pid in $(ns_pids); do kill "-$sig" "$pid" 2>/dev/null || true; done
}

teardown() {
  local rc=$?
  trap - EXIT
  [ -n "${DIR:-}" ] && [ -f "$DIR/cluster.env" ] || exit "$rc"
  local _
  signal_all TERM
  for _ in $(seq 100); do [ "$(alive)" -eq 0 ] && break; sleep 0.1; done
  if [ "$(alive)" -ne 0 ]; then signal_all KILL; sleep 0.5; fi
  local left; left="$(alive)"
  [ -f "$DIR/netns" ] && while read -r ns; do ip netns del "$ns" 2>/dev/null || true; done <"$DIR/netns"
  rm -rf "$DIR"
  [ "$left" -eq 0 ] || { echo "error: $left processes survived SIGKILL" >&2; exit 1; }
  log "down: processes ended, namespaces deleted, $DIR removed"
  exit "$rc"
}

# ---------------------------------------------------------------- jobs
# "JobState ExitCode" of JOB, e.g. "COMPLETED 0:0" (empty when the controller does not answer).
job_state() {
  in_ctl timeout 10 scontrol show job -o "$1" 2>/dev/null \
    | sed -n 's/.*JobState=\([A-Z_]*\).* ExitCode=\([0-9]*:[0-9]*\).*/\1 \2/p'
}

# Poll JOB every 0.5 s until it ends; its exit code (128+signal; 1 if it failed without one).
# (`sbatch --wait` polls after 2, 10, 42, 74... s, which adds up to 32 s to every job.)
wait_job() {
  local job="$1" deadline=$((SECONDS + ${JOB_TIMEOUT:-1800})) state code
  while [ "$SECONDS" -lt "$deadline" ]; do
    read -r state code <<<"$(job_state "$job")" || true
    case "${state:-}" in
      ""|PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED|REQUEUED|RESIZING) sleep 0.5 ;;
      *) local ec="${code%%:*}" sig="${code##*:}"
         [ "${sig:-0}" -eq 0 ] || ec=$((128 + sig))
         [ "$state" = COMPLETED ] || [ "${ec:-0}" -ne 0 ] || ec=1
         log "job $job $state (exit code $code)"; return "${ec:-1}" ;;
    esac
  done
  in_ctl scancel "$job" || true
  log "job $job timed out after ${JOB_TIMEOUT:-1800} s: cancelled"
  return 124
}

# Submit in the ctl namespace from the caller's directory; prints the job's output file;
# returns the job's exit code.
do_submit() {
  [ "$#" -gt 0 ] || die "submit: give an sbatch file (and sbatch options before it)"
  mkdir -p "$DIR/jobs"
  local job rc=0 t0=$SECONDS
  job="$(in_ctl sbatch --parsable --output="$DIR/jobs/%j.out" "$@")" || die "sbatch refused the job"
  job="${job%%;*}"
  log "submitted job $job"
  wait_job "$job" || rc=$?
  cat "$DIR/jobs/$job.out" 2>/dev/null || true
  log "job $job exit $rc in $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || grep -hv pmix "$DIR"/log/slurm*.log | tail -n 20 >&2 || true
  return "$rc"
}

# Three nodes, the trainer's link shaped; one fan-out job per replica count; the runs' summaries merged.
do_fanout() {
  local rate="$1" r rc=0
  NODES=(n1 n2 n3)
  do_up ""
  [ -z "$rate" ] || shape "$rate" n1
  for r in ${FANOUT_REPLICAS:-1 2 4}; do
    export REPLICAS="$r"
    do_submit recipes/slurm/fanout.sbatch || { rc=$?; break; }
  done
  [ "$rc" -ne 0 ] || PYTHONPATH="$PWD" "${PYTHON:-$PWD/.venv/bin/python}" -m nemo_dcr.tools.fanout --role merge \
    --workdir runs/slurm-fanout >/dev/null || rc=$?
  [ "$rc" -ne 0 ] || log "fan-out runs: runs/slurm-fanout/summary.json"
  exit "$rc"
}

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

main() {
  local cmd="${1:-}"; [ "$#" -gt 0 ] && shift
  local rate=""
  DIR=""
  while [ "$#" -gt 0 ]; do
    case "$1" in
      --rate) rate="$2"; shift 2 ;;
      --dir) DIR="$2"; shift 2 ;;
      *) break ;;
    esac
  done
  case "$cmd" in
    up) do_up "$rate"; trap - EXIT; echo "$DIR" ;;
    submit) load_state; do_submit "$@" ;;
    shape) load_state; shape "${1:?shape: give a rate such as 100mbit, or off}" ;;
    down) load_state; trap teardown EXIT ;;
    check) do_up "$rate"; local rc=0; do_submit "$@" || rc=$?; exit "$rc" ;;
    fanout) do_fanout "$rate" ;;
    -h|--help|help) usage 0 ;;
    *) usage 2 ;;
  esac
}

main "$@"
