set -x
run() { name=$1; shift; timeout 150 python3 -u -c "
import runpy, sys
import ling_jax.ops.expert_gemv as g
for kv in '$*'.split():
    k, v = kv.split('='); setattr(g, k, int(v))
sys.argv = ['bench/decode.py', '--batches', '1', '--contexts', '1024', '--out', '$OUT/decode_b1_$name.json']
runpy.run_path('bench/decode.py', run_name='__main__')
" > $OUT/log_$name.txt 2>&1; grep -i "ms/step\|ms per\|batch" $OUT/log_$name.txt | tail -3; }
run old TARGET_PROGRAMS=0 NUM_STAGES=1
run tp264 
run tp528 TARGET_PROGRAMS=528
run tp264w8 NUM_WARPS=8
PYTHONPATH=$PWD timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_expert_gemv.py 2>&1 | tail -2
