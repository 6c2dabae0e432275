#!/bin/bash
# A Slurm array job: each task answers its part of the prompts (a stable hash of the id decides which), in its own
# OUT/shard-IIIII-of-NNNNN directory. A preempted or timed-out task stops cleanly and resumes when requeued.
#
#   sbatch examples/slurm-array.sh                                  # 4 tasks, as below
#   sbatch --array=0-1 --export=ALL,INPUT=prompts.jsonl,OUT=out examples/slurm-array.sh
#   # once every task is done (or: sbatch --dependency=afterok:<jobid> --wrap "cbgen merge out"):
#   .venv/bin/cbgen status out && .venv/bin/cbgen merge out     # checks every id is there exactly once
#
#SBATCH --job-name=cbgen
#SBATCH --array=0-3
#SBATCH --cpus-per-task=2
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:TERM@60
#SBATCH --output=cbgen-%A_%a.log
set -euo pipefail
# Slurm starts the script in the directory sbatch ran in (or the one given with --chdir): the default paths below are
# relative to it, so submit from the repository root or pass --chdir=<repository root>.
# --signal=B:TERM@60 sends SIGTERM 60 s before the time limit; exec makes cbgen the process that receives it: it
# writes what has finished and exits 75, and the requeued (or resubmitted) task resumes where it stopped.
exec "${CBGEN:-.venv/bin/cbgen}" run "${INPUT:-examples/prompts.jsonl}" -o "${OUT:-cbgen-out-array}" \
    --config "${CONFIG:-examples/job.yaml}"
