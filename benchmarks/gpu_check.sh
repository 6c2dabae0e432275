#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a machine without network whose Python has torch, but not cbgen's pins:
# it installs the wheels carried in .whl/ into /tmp/site, puts them and this checkout first on PYTHONPATH, and runs
# the check with the arguments given. docs/gpu.md says what it checks.
#
#   bash benchmarks/gpu_check.sh prepare        # here, with network: the wheels and the tokenizer into .whl/
#   bash benchmarks/gpu_check.sh --out "$OUT"   # there (the device tool: carry [".whl"])
#
# The wheels are what the check imports that the device image (Python 3.12, torch 2.11, transformers 5.17, peft,
# sentence-transformers) lacks or has at a version cbgen cannot use; docs/gpu.md lists them with their sizes.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    transformers==5.23.0   # cbgen's pin (the image has 5.17)
    huggingface_hub==1.33.0  # transformers 5.23 needs >= 1.31; 1.x keeps the image's own dependencies (httpx)
    llguidance==1.9.1      # JSON schemas
)

if [[ "${1:-}" == "prepare" ]]; then
    python=${PYTHON:-.venv/bin/python}
    mkdir -p .whl
    rm -f .whl/*.whl
    for wheel in "${WHEELS[@]}"; do
        # manylinux_2_31: llguidance 1.9's only Linux wheel (glibc >= 2.31)
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$wheel"
    done
    rm -rf .whl/tokenizer
    "$python" benchmarks/gpu_check.py --prepare-tokenizer .whl/tokenizer >/dev/null
    du -b .whl/*.whl .whl/tokenizer | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2; total += $1}
        END {printf "%8.2f MiB  in all (the device tool carries at most 64 MiB with the checkout)\n", total / 1048576}'
    exit 0
fi

if ! compgen -G ".whl/*.whl" >/dev/null || [[ ! -f .whl/tokenizer/tokenizer.json ]]; then
    echo "gpu_check.sh: .whl/ has no wheels or no tokenizer: run 'bash benchmarks/gpu_check.sh prepare' first" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
exec python3 benchmarks/gpu_check.py --tokenizer .whl/tokenizer "$@"
