#!/usr/bin/env bash
# The serving tables of BENCHMARKS.md, one part per device call (each fits its 600 s limit), results under
# $OUT. Usage: bash bench/serving_tables.sh c64|c1c16|prefix|spec|trace  (any order; a shared compilation cache in
# /tmp/jcc shortens the later parts of one warm machine).
#   c64:    concurrency 64 against static `generate` (64 slots)
#   c1c16:  concurrency 16 and 1 (16 slots, decode buckets 1 and 16)
#   prefix: the prefix cache on multi-turn chats and on a shared 4,096-token prefix, against the cache off
#   spec:   MTP speculative decoding, 1-3 drafts, batch 1 and 16 at 1k and 32k contexts
#   trace:  c64's engine run (no static), its device timeline over 3 s from 6 s into the workload
set -u
case "${1:-}" in c64|c1c16|prefix|spec|trace) ;; *) echo "usage: bash bench/serving_tables.sh c64|c1c16|prefix|spec|trace" >&2
  exit 2 ;; esac
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 JAX_COMPILATION_CACHE_DIR=/tmp/jcc PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' | tr A-Z a-z)
S=$(date +%s)
run() { local limit=$1; shift; echo "=== [+$(( $(date +%s) - S ))s] $* (limit ${limit}s)"
        timeout "$limit" "$@" 2>&1 | grep -v -i warn | tail -30; }
serve=(python3 bench/serve.py --preset ling-3.0-tiny --random-weights --prefill-chunk 512)
c16=("${serve[@]}" --max-batch 16 --max-len 4608 --compile-threads 16)
spec=(python3 bench/decode.py --preset ling-3.0-tiny --steps 8 --reps 5 --speculative-tokens 1 2 3)
case "${1:-}" in
  c64) run 585 "${serve[@]}" --max-batch 64 --max-len 2560 --prompt-len 256:2048 --output-len 64:512 \
         --concurrency 64 --num-requests 128 --static --out "$OUT/serve_${gpu}_c64.json" ;;
  trace) run 585 "${serve[@]}" --max-batch 64 --max-len 2560 --prompt-len 256:2048 --output-len 64:512 \
           --concurrency 64 --num-requests 128 --profile /tmp/prof --profile-window 6:3 \
           --out "$OUT/serve_${gpu}_c64_trace.json" ;;
  c1c16) run 585 "${c16[@]}" --prompt-len 256:2048 --output-len 64:512 --concurrency 16 --num-requests 48 \
           --decode-buckets 1 --also-concurrency 1:8 --out "$OUT/serve_${gpu}_c1_c16.json" ;;
  prefix) run 290 "${c16[@]}" --multi-turn 6 --prompt-len 256:256 --output-len 64:64 --concurrency 16 \
            --num-requests 16 --compare-prefix-cache --out "$OUT/serve_${gpu}_prefix_multiturn.json"
          run 290 "${c16[@]}" --shared-prefix 4096 --prompt-len 256:256 --output-len 64:64 --concurrency 16 \
            --num-requests 48 --compare-prefix-cache --out "$OUT/serve_${gpu}_prefix_shared.json" ;;
  spec) run 200 "${spec[@]}" --batches 1 --contexts 1024 32768 --out "$OUT/decode_spec_${gpu}_b1.json"
        run 170 "${spec[@]}" --batches 16 --contexts 1024 --out "$OUT/decode_spec_${gpu}_b16_c1024.json"
        run 200 "${spec[@]}" --batches 16 --contexts 32768 --out "$OUT/decode_spec_${gpu}_b16_c32768.json" ;;
esac
echo "=== [+$(( $(date +%s) - S ))s] done"; ls -la "$OUT"
