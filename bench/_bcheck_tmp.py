import sys, json, os
sys.path.insert(0, '.')
import jax, numpy as np
import bench.persistent_layer as m
sms = jax.devices()[0].core_count if jax.default_backend() == "gpu" else 4
out = []
for write, acquire, read in [("store", "own", "plain"), ("store", "own", "volatile"), ("atomic", "all", "volatile"),
                             ("store", "all", "plain")]:
    m.WRITE, m.ACQUIRE, m.READ = write, acquire, read
    for k in (1, 2):
        P = k * sms
        sums, flags = jax.jit(lambda: m.barrier_check(P))()
        sums = np.asarray(sums); r = np.arange(sums.shape[0])[:, None]
        bad = sums != r * P * P + P * (P - 1) // 2
        row = dict(write=write, acquire=acquire, read=read, per_sm=k, wrong=int(bad.sum()), of=int(bad.size),
                   flags_ok=bool((np.asarray(flags) == 8).all()), wrong_by_round=bad.sum(1).tolist(),
                   wrong_pids=np.nonzero(bad.any(0))[0].tolist()[:20])
        print(row, flush=True); out.append(row)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/barrier_check.json", "w"), indent=1)
