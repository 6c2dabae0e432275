#!/bin/bash
# Start or resume a generation job from cron. A crontab line such as
#
#   */30 * * * * /path/to/cbgen/examples/cron.sh >> /path/to/cbgen/cron.log 2>&1
#
# runs this every 30 minutes: the first run starts the job, a run that finds it finished does nothing (exit 0,
# without loading the model), one that finds it interrupted resumes it, and one that finds it still running is
# refused by the output directory's lock (exit 2) without touching anything. Without a terminal, progress goes to
# the log as a plain line every few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/cbgen run "${INPUT:-examples/prompts.jsonl}" -o "${OUT:-cbgen-out-cron}" --config examples/job.yaml
