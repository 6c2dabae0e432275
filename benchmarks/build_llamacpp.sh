#!/usr/bin/env bash
# Builds llama.cpp for `cbgen bench --paths ...,llamacpp` and for a direct `llama-batched-bench` run, from the
# llama-cpp-python source distribution on the package registry (no git, no internet beyond the registry):
#
#   1. downloads the sdist of llama-cpp-python (which vendors llama.cpp) and unpacks it;
#   2. builds llama.cpp's shared libraries and `llama-batched-bench` with cmake, for this CPU (-march=native);
#   3. installs llama-cpp-python's Python bindings into the current environment without building the library a
#      second time, and puts the libraries built in step 2 beside them;
#   4. converts the embedded SmolLM2-135M, as cbgen loads it (dequantised from its Q4_1 GGUF), to f32 and bf16 GGUF
#      files with llama.cpp's own convert_hf_to_gguf.py, so that both engines run the same weights; and to Q8_0,
#      the quantization a llama.cpp user would pick on a CPU (the `llamacpp-q8_0` path of cbgen bench).
#
# Usage:  bash benchmarks/build_llamacpp.sh          (about 15-25 minutes on 2 cores; CI does not run it)
# Then:   cbgen bench --workloads fixed --paths cbgen,llamacpp
#         $DIR/build/bin/llama-batched-bench -m $DIR/models/SmolLM2-135M-Instruct-f32.gguf -c 13000 -b 2048 \
#             -ub 512 -npp 128 -ntg 64 -npl 64 -t 2 -tb 2
#
# Environment: CBGEN_LLAMACPP_DIR (default: llamacpp in cbgen's cache directory, $CBGEN_CACHE_DIR or ~/.cache/cbgen),
# LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default: all cores), PYTHON (default: .venv/bin/python if it exists,
# else python).
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${CBGEN_LLAMACPP_DIR:-${CBGEN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cbgen}/llamacpp}
JOBS=${JOBS:-$(nproc)}
# the project's .venv when there is one: the conversion step loads the model with cbgen, which needs its torch
PY=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo "$PWD/.venv/bin/python"; else echo python; fi)}
SRC=$DIR/llama_cpp_python-$VERSION
mkdir -p "$DIR" "$DIR/models"

if [ ! -d "$SRC" ]; then
  echo "== downloading llama-cpp-python $VERSION (sdist)"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
  tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi

echo "== building llama.cpp (shared libraries + llama-batched-bench) with $JOBS jobs"
cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > "$DIR/cmake-config.log"
cmake --build "$DIR/build" --target llama-batched-bench -j "$JOBS" > "$DIR/cmake-build.log"

echo "== installing the Python bindings (llama_cpp) with the libraries just built"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --quiet "$SRC"
LIB=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")/llama_cpp/lib
mkdir -p "$LIB"
cp -P "$DIR"/build/bin/lib*.so* "$LIB"/
"$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'loads its library')"

echo "== converting the embedded SmolLM2-135M to f32, bf16 and Q8_0 GGUF"
HF=$DIR/models/SmolLM2-135M-Instruct-hf
if [ ! -f "$HF/config.json" ]; then
  HF_HUB_OFFLINE=1 "$PY" - "$HF" <<'EOF'
import sys
from cbgen.config import ModelSection
from cbgen.model.load import load_model

loaded = load_model(ModelSection(dtype="float32", device="cpu"))  # the embedded model, as cbgen runs it
loaded.model.save_pretrained(sys.argv[1])
loaded.tokenizer.save_pretrained(sys.argv[1])
EOF
fi
"$PY" -m pip install --quiet sentencepiece  # the converter imports it even for BPE tokenizers such as SmolLM2's
for TYPE in f32 bf16 q8_0; do
  OUT=$DIR/models/SmolLM2-135M-Instruct-$TYPE.gguf
  if [ ! -f "$OUT" ] && ! PYTHONPATH="$SRC/vendor/llama.cpp/gguf-py" HF_HUB_OFFLINE=1 \
      "$PY" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$HF" --outtype "$TYPE" --outfile "$OUT" > "$OUT.log" 2>&1; then
    tail -3 "$OUT.log"; echo "build_llamacpp.sh: converting to $TYPE failed; the whole log is $OUT.log" >&2; exit 1
  fi
  echo "   $OUT"
done
echo "== done: cbgen bench --workloads fixed --paths cbgen,llamacpp"
