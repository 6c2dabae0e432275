#!/bin/bash
# A job split into shards that run as tasks on a Ray cluster, then merged (pip install 'cbgen[ray]').
#
#   RAY_ADDRESS=head-node:6379 bash examples/ray.sh              # a cluster started with `ray start --head`
#   bash examples/ray.sh                                          # no RAY_ADDRESS: a local Ray on this machine
#   SHARDS=8 GPUS=1 INPUT=/shared/prompts.jsonl OUT=/shared/out bash examples/ray.sh
#
# OUT (and INPUT) must be on storage every node of the cluster sees. Rerunning the same command resumes: finished
# shards are skipped, a shard that was cut short continues where it stopped. Exit 0 once DIR/merged holds every id.
set -euo pipefail
exec "${CBGEN:-.venv/bin/cbgen}" run "${INPUT:-examples/prompts.jsonl}" -o "${OUT:-cbgen-out-ray}" \
    --executor ray --num-shards "${SHARDS:-2}" --ray-num-cpus "${CPUS:-1}" --ray-num-gpus "${GPUS:-0}" \
    --config "${CONFIG:-examples/job.yaml}" ${MODEL:+--model "$MODEL"} "$@"
