#!/usr/bin/env bash
# Runs examples/slurm-array.sh as a 2-task array job on a real one-node Slurm cluster that it starts on this
# machine, then checks the result: both tasks ran (one shard directory each), `cbgen status` and `cbgen merge`
# succeed, and the merged output holds every input id exactly once.
#
#   sudo bash .ci/slurm-test.sh    # needs root and the venv (make test); installs Slurm and MUNGE from apt if missing
#
# Everything it starts (munged, slurmctld, slurmd, the job) lives in a private temporary directory, on free ports
# and a private MUNGE socket, so it does not touch a system-wide Slurm or MUNGE; all of it is stopped on exit.
# Environment: SLURM_TEST_TIMEOUT (seconds to wait for the job, default 600), SLURM_TEST_KEEP=1 (keep the
# temporary directory even on success).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CBGEN=$REPO/.venv/bin/cbgen
PYTHON=$REPO/.venv/bin/python
JOB_TIMEOUT=${SLURM_TEST_TIMEOUT:-600}
NODE=$(hostname -s)
export HF_HUB_OFFLINE=1
START=$SECONDS

WORK=""           # the temporary directory (set below)
JOBID=""
MUNGED_PID="" SLURMCTLD_PID="" SLURMD_PID=""
POLICY_ADDED=""   # a policy-rc.d this script created for the install, removed again on exit
FAILED=""         # the one-line reason, once something failed

log() { echo "[slurm-test $(date +%T)] $*"; }
fail() { FAILED=$*; echo "slurm test: FAIL: $*" >&2; exit 1; }
on_error() { [ -n "$FAILED" ] || { FAILED="line $1: \`$2\` exited $3"; echo "slurm test: FAIL: $FAILED" >&2; }; }
trap 'on_error "$LINENO" "$BASH_COMMAND" "$?"' ERR

# --- cleanup: always runs ------------------------------------------------------------------------------------------

stop_pid() {  # stop_pid PID NAME: SIGTERM, wait up to 15 s, then SIGKILL
    local pid=$1 name=$2 i
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 30); do kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }; sleep 0.5; done
    log "$name (pid $pid) ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

show_logs() {
    local f
    for f in "$WORK"/munged.log "$WORK"/munged.out "$WORK"/slurmctld.log "$WORK"/slurmd.log \
        "$WORK"/slurmctld.out "$WORK"/slurmd.out "$WORK"/cbgen-*.log; do
        [ -s "$f" ] || continue
        # a daemon's .out repeats its .log; it matters only when the daemon died before opening the log
        [[ $f == *.out && -s ${f%.out}.log ]] && continue
        echo "===== $f (last 60 lines) =====" >&2
        tail -n 60 "$f" >&2
    done
}

cleanup() {
    local rc=$? i p
    trap - ERR
    set +e
    [ "$rc" -eq 0 ] || [ -n "$FAILED" ] || FAILED="exited $rc"
    if [ -n "$JOBID" ] && [ -n "$SLURMCTLD_PID" ] && kill -0 "$SLURMCTLD_PID" 2>/dev/null; then
        if [ -n "$(squeue -h -j "$JOBID" -o %i 2>/dev/null)" ]; then
            log "cancelling job $JOBID"
            scancel "$JOBID" 2>/dev/null
            for i in $(seq 30); do [ -z "$(squeue -h -j "$JOBID" -o %i 2>/dev/null)" ] && break; sleep 1; done
        fi
    fi
    if [ -n "$FAILED" ] && [ -n "$WORK" ]; then
        [ -n "$SLURMCTLD_PID" ] && [ -n "$JOBID" ] && scontrol show job "$JOBID" >&2 2>/dev/null
        show_logs
    fi
    stop_pid "$SLURMD_PID" slurmd
    stop_pid "$SLURMCTLD_PID" slurmctld
    stop_pid "$MUNGED_PID" munged
    # Anything else this run started (job steps, a slurmstepd) carries our marker in its environment.
    if [ -n "$WORK" ]; then
        unset CBGEN_SLURM_TEST_RUN
        for p in /proc/[0-9]*; do
            p=${p#/proc/}
            [ "$p" = "$$" ] && continue
            if grep -qzxF "CBGEN_SLURM_TEST_RUN=$WORK" "/proc/$p/environ" 2>/dev/null; then
                log "stopping leftover process $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-80))"
                kill -KILL "$p" 2>/dev/null
            fi
        done
    fi
    [ -n "$POLICY_ADDED" ] && rm -f /usr/sbin/policy-rc.d
    if [ -n "$WORK" ]; then
        if [ -n "$FAILED" ] || [ "${SLURM_TEST_KEEP:-0}" = 1 ]; then
            log "kept $WORK for inspection"
        else
            rm -rf "$WORK"
        fi
    fi
    [ -z "$FAILED" ] || echo "slurm test: FAIL: $FAILED" >&2   # again, below the logs
    exit "$rc"
}
trap cleanup EXIT
trap 'fail "interrupted"' INT TERM

[ "$(id -u)" = 0 ] || fail "run as root: it installs packages and runs slurmctld, slurmd and munged"
[ -x "$CBGEN" ] || fail "$CBGEN is missing: run 'make test' (or 'make install') first"

# --- 1. install Slurm and MUNGE from Debian's packages if missing --------------------------------------------------

PACKAGES=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Keep the packages' maintainer scripts from starting system-wide daemons; this test starts its own.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && POLICY_ADDED=1
    fi
    if ! apt-cache show slurmctld >/dev/null 2>&1; then
        apt-get update -qq || fail "apt-get update failed"
    fi
    if ! apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
        log "install failed; updating the package lists and retrying"
        apt-get update -qq || fail "apt-get update failed"
        apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null \
            || fail "apt-get install ${PACKAGES[*]} failed"
    fi
    [ -n "$POLICY_ADDED" ] && rm -f /usr/sbin/policy-rc.d && POLICY_ADDED=""
fi
for c in munged slurmctld slurmd sbatch squeue sinfo scontrol scancel; do
    command -v "$c" >/dev/null || fail "$c not found after installing ${PACKAGES[*]}"
done
log "$(slurmd -V), $(munged --version 2>&1 | awk '{print $1; exit}')"

# --- 2. a one-node cluster in a temporary directory -----------------------------------------------------------------

WORK=$(mktemp -d /tmp/cbgen-slurm-test.XXXXXX)
chmod 700 "$WORK"
export CBGEN_SLURM_TEST_RUN=$WORK   # marks every process of this run (daemons inherit it, sbatch exports it)
mkdir -p "$WORK"/munge "$WORK"/state "$WORK"/spool "$WORK"/out
log "working in $WORK"

# MUNGE, on a private key and socket
MUNGE_SOCKET=$WORK/munge/munge.socket
if command -v mungekey >/dev/null; then
    mungekey --create --keyfile="$WORK/munge/munge.key" || fail "mungekey could not create a key"
else
    dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 600 "$WORK/munge/munge.key"
# --force: without it munged refuses a socket in a directory others cannot enter (this 0700 one)
munged --force --socket="$MUNGE_SOCKET" --key-file="$WORK/munge/munge.key" --pid-file="$WORK/munge/munged.pid" \
    --seed-file="$WORK/munge/munged.seed" --log-file="$WORK/munged.log" >"$WORK/munged.out" 2>&1 \
    || fail "munged did not start: $(tail -n 1 "$WORK/munged.out")"
MUNGED_PID=$(cat "$WORK/munge/munged.pid")
for i in $(seq 50); do
    munge --socket="$MUNGE_SOCKET" -n 2>/dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1 && break
    kill -0 "$MUNGED_PID" 2>/dev/null || fail "munged exited at start (see its log above)"
    [ "$i" -lt 50 ] || fail "munged did not answer on $MUNGE_SOCKET within 10 s"
    sleep 0.2
done

# slurm.conf, sized from what slurmd detects on this machine, on two free ports
read -r -a HW < <(slurmd -C 2>/dev/null | head -n 1)
[ "${#HW[@]}" -gt 1 ] && [[ ${HW[0]} == NodeName=* ]] || fail "slurmd -C did not report this machine's hardware"
read -r CTLD_PORT SLURMD_PORT < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export SLURM_CONF=$WORK/slurm.conf
cat >"$SLURM_CONF" <<EOF
# written by .ci/slurm-test.sh
ClusterName=cbgentest
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 ${HW[*]:1} State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -D -f "$SLURM_CONF" >"$WORK/slurmctld.out" 2>&1 &
SLURMCTLD_PID=$!
slurmd -D -f "$SLURM_CONF" -N "$NODE" >"$WORK/slurmd.out" 2>&1 &
SLURMD_PID=$!
state=""
for i in $(seq 60); do
    kill -0 "$SLURMCTLD_PID" 2>/dev/null || fail "slurmctld exited at start (see its log above)"
    kill -0 "$SLURMD_PID" 2>/dev/null || fail "slurmd exited at start (see its log above)"
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    [ "$state" = idle ] && break
    [ "$i" -lt 60 ] || fail "node $NODE is not idle after 60 s (sinfo says '${state:-nothing}')"
    sleep 1
done
log "cluster up: node $NODE idle ($(sinfo -h -n "$NODE" -o '%c CPUs, %m MB'))"

# --- 3. the array job ------------------------------------------------------------------------------------------------

INPUT=$WORK/prompts.jsonl
OUT=$WORK/out
cat >"$INPUT" <<'EOF'
{"id": "p0", "prompt": "Name a colour."}
{"id": "p1", "prompt": "What is the capital of Italy?"}
{"id": "p2", "prompt": "Give one word that rhymes with cat."}
{"id": "p3", "prompt": "How many legs does a spider have?"}
{"id": "p4", "prompt": "Name a planet in the solar system."}
{"id": "p5", "prompt": "What is 3 plus 4?"}
{"id": "p6", "prompt": "Name a fruit that is yellow."}
{"id": "p7", "prompt": "What do bees make?"}
{"id": "p8", "prompt": "Name a musical instrument."}
{"id": "p9", "prompt": "What is the opposite of hot?"}
{"id": "p10", "prompt": "Which animal says moo?"}
{"id": "p11", "prompt": "Name a day of the week."}
EOF
N_IDS=$(wc -l <"$INPUT")

# Submitted from the temporary directory: --chdir alone must put the job in the repository.
cd "$WORK"
JOBID=$(sbatch --parsable --array=0-1 --chdir="$REPO" \
    --export="ALL,INPUT=$INPUT,OUT=$OUT,CBGEN=$CBGEN,CONFIG=examples/job.yaml" \
    --output="$WORK/cbgen-%A_%a.log" "$REPO/examples/slurm-array.sh") || fail "sbatch refused the job"
JOBID=${JOBID%%;*}
log "submitted array job $JOBID (2 tasks)"

# --- 4. wait, then check ---------------------------------------------------------------------------------------------

deadline=$((SECONDS + JOB_TIMEOUT))
last=""
while :; do
    queue=$(squeue -h -j "$JOBID" -o '%i %T %R' 2>&1) || fail "squeue failed: $queue"
    [ -z "$queue" ] && break
    now=$(echo "$queue" | tr '\n' ';')
    [ "$now" != "$last" ] && log "queue: $now" && last=$now
    [ "$SECONDS" -lt "$deadline" ] || fail "job $JOBID still queued or running after ${JOB_TIMEOUT} s"
    sleep 3
done

# Accounting is off, so the task states come from slurmctld's job records (kept for MinJobAge).
states=$(scontrol -o show job "$JOBID" \
    | sed -n 's/.*ArrayTaskId=\([0-9]*\) .*JobState=\([A-Z_]*\) .* ExitCode=\([0-9:]*\).*/\1 \2 \3/p' | sort)
log "tasks: $(echo "$states" | tr '\n' ';')"
[ "$(echo "$states" | grep -c ' COMPLETED 0:0$')" = 2 ] \
    || fail "the 2 array tasks did not both complete with exit 0: $(echo "$states" | tr '\n' ';')"
for t in 0 1; do
    [ -s "$WORK/cbgen-${JOBID}_$t.log" ] || fail "task log $WORK/cbgen-${JOBID}_$t.log is missing or empty"
done
for d in shard-00000-of-00002 shard-00001-of-00002; do
    [ -d "$OUT/$d" ] || fail "$OUT/$d is missing: the tasks did not run as 2 separate array shards"
done
"$CBGEN" status "$OUT" || fail "cbgen status $OUT exited $?"
"$CBGEN" merge "$OUT" || fail "cbgen merge $OUT exited $?"
"$PYTHON" - "$INPUT" "$OUT" <<'EOF' || fail "the merged output does not hold every input id exactly once"
import collections, json, pathlib, sys

input_path, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
expected = [json.loads(line)["id"] for line in input_path.read_text().splitlines() if line.strip()]

def ids(directory):
    found = []
    for part in sorted(directory.glob("part-*")):
        if part.suffix == ".jsonl":
            found += [json.loads(line)["id"] for line in part.read_text().splitlines() if line.strip()]
        else:
            import pyarrow.parquet as pq
            found += pq.read_table(part, columns=["id"]).column("id").to_pylist()
    return found

merged = collections.Counter(ids(out / "merged"))
problems = [f"{i}: {merged[i]} times" for i in expected if merged[i] != 1]
problems += [f"{i}: not an input id" for i in merged if i not in expected]
for shard in ("shard-00000-of-00002", "shard-00001-of-00002"):
    if not ids(out / shard):
        problems.append(f"{shard} holds no rows")
    if json.loads((out / shard / "run.json").read_text()).get("status") != "complete":
        problems.append(f"{shard}/run.json does not say complete")
if problems:
    print("merged output:", "; ".join(problems), file=sys.stderr)
    sys.exit(1)
EOF

echo "slurm test: OK ($N_IDS ids, 2 tasks) in $((SECONDS - START)) s"
