#!/bin/bash
# A pipeline bigger than one machine: each generate or score stage as a Slurm array (each task one shard of the
# stage, chosen by a stable hash of the id), each sql stage as one task, chained with dependencies so that a stage
# starts once the one before it has ended. Run it on the login node; it submits the jobs and prints their ids:
#
#   bash examples/pipeline-slurm.sh                                         # the example pipeline, 4 tasks a stage
#   TASKS=16 bash examples/pipeline-slurm.sh my-pipeline.yaml my-out        # yours
#   .venv/bin/cbgen status my-out                                           # each stage's progress, meanwhile
#
# A task that is preempted or times out stops cleanly (exit 75) and resumes when requeued. If a stage is still
# incomplete when the next one starts (a task that failed for good), the next stage says which and exits 2: run
# `cbgen pipeline FILE -o OUT` (on any machine) to finish what is left, or submit this script again: finished
# stages and shards are skipped.
set -euo pipefail
PIPELINE=${1:-examples/synth/pipeline.yaml}
OUT=${2:-synth-pipeline}
TASKS=${TASKS:-4}
CBGEN=${CBGEN:-.venv/bin/cbgen}
SBATCH=${SBATCH:-sbatch}
# a bad pipeline (an unknown stage, a cycle, an SQL error, a missing column) stops here, before anything is queued
stages=$("$CBGEN" pipeline "$PIPELINE" -o "$OUT" --check --json | python3 -c \
    'import json, sys; print(" ".join(s["stage"] + ":" + s["kind"] for s in json.load(sys.stdin)["stages"]))')
previous=""
for entry in $stages; do
    name=${entry%%:*} kind=${entry##*:}
    options=(--parsable --job-name="cbgen-$name" --cpus-per-task=2 --time=04:00:00 --requeue
             --signal=B:TERM@60 --output="cbgen-$name-%A_%a.log")
    [ "$kind" != sql ] && options+=(--array="0-$((TASKS - 1))")
    # afterany: a stage whose rows partly failed (exit 1) is complete, and the next one reads its good rows
    [ -n "$previous" ] && options+=(--dependency="afterany:$previous")
    printf -v command '%q ' "$CBGEN" pipeline "$PIPELINE" -o "$OUT" --stage "$name"
    previous=$("$SBATCH" "${options[@]}" --wrap "exec $command")
    echo "stage $name ($kind): job $previous"
done
