#!/usr/bin/env bash
# One device call that runs every H200 benchmark with its own time limit, results under $OUT.
# Usage (device tool, carry .whl): bash bench/h200_run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
mkdir -p /tmp/tcache && tar xzf .whl/fla_autotune.tgz -C /tmp/tcache 2>/dev/null; export TRITON_CACHE_DIR=/tmp/tcache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
run() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tail -40; }
run "${DECODE_S:-300}" python3 bench/decode.py --out "$OUT/decode_h200.json"
run "${KERNELS_S:-150}" python3 bench/decode_kernels.py --out "$OUT/decode_kernels_h200.json"
run "${PREFILL_S:-80}" python3 bench/prefill_mla.py --out "$OUT/prefill_mla_h200.json"
run "${MOE_S:-120}" python3 bench/moe.py --out "$OUT/moe_h200.json"
run "${CONV_S:-120}" python3 bench/short_conv.py --out "$OUT/short_conv_h200.json"
run "${LSE_S:-60}" python3 bench/logsumexp.py --out "$OUT/logsumexp_h200.json"
run "${ROUTER_S:-60}" python3 bench/router_matmul.py --out "$OUT/router_matmul_h200.json"
run "${MLA_S:-120}" python3 bench/mla_attention.py --out "$OUT/mla_attention_h200.json"
run "${TRAIN_S:-300}" python3 bench/train.py --out "$OUT/train_h200.json" --kda-impl pallas --remat dots_kernels \
  --unroll-layers
run "${KDA_S:-250}" python3 bench/kda.py --heads 16 64 --out "$OUT"
run "${KDA_PK_S:-90}" python3 bench/kda.py --per-kernel --heads 64 --out "$OUT"
(cd /tmp/tcache && find . -name '*.autotune.json' | tar czf "$OUT/fla_autotune.tgz" -T -)  # carry it into .whl next time
ls -la "$OUT"
