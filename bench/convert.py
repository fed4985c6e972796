"""Benchmark of ling-convert / ling-export on this machine: GB/s and peak RSS for two model sizes.

Generates random block-FP8 HF checkpoints with numpy (`checkpoint/synthetic.py`) whose largest
tensor is the same (the [vocab, hidden] embedding and head) while the number of layers differs,
then runs each command in a fresh subprocess and records its wall time (of the conversion call,
imports excluded) and its peak resident set size (`VmHWM` of /proc/self/status, imports included).
A bound that holds for both sizes shows that memory does not grow with the model.

    .venv/bin/python bench/convert.py --layers 8 24 --out bench/results/convert_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ling_jax.checkpoint.synthetic import (
    LING_FP8_EXCLUSIONS,
    hf_tensor_specs,
    scaled_config,
    write_random_hf_checkpoint,
)
from ling_jax.config import QuantConfig

# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across execve, so a child would report
# the larger RSS of the parent it was forked from (this script, after generating a checkpoint)
RUN = """
import sys, time
from ling_jax.checkpoint.{module} import main
t = time.perf_counter()
rc = main(sys.argv[1:])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("RESULT", time.perf_counter() - t, hwm * 1024)
sys.exit(rc)
"""


def _run(module: str, args: list[str]) -> tuple[float, int]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", RUN.format(module=module), *args, "--quiet"], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{module} failed:\n{r.stderr[-3000:]}")
    secs, rss = r.stdout.split("RESULT")[1].split()
    return float(secs), int(rss)


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _load() -> float:
    return os.getloadavg()[0]


def _disk_write_rate(work: Path, nbytes: int = 512 << 20) -> float:
    """GB/s of one sequential fsynced write of random bytes: the ceiling for writing a checkpoint here."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    t = time.perf_counter()
    with open(work / "disk-probe", "wb") as f:
        f.write(data.data)
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t
    (work / "disk-probe").unlink()
    return nbytes / 1e9 / secs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 24], help="model sizes (number of layers)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ling-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    quant = QuantConfig(block_size=(128, 128), exclusions=LING_FP8_EXCLUSIONS)
    disk = _disk_write_rate(work)
    rows = []
    for layers in args.layers:
        cfg = scaled_config(layers)
        specs = hf_tensor_specs(cfg, quant)
        largest = max(d.itemsize * int(np.prod(s)) for _, d, s, _ in specs)
        src = work / f"src{layers}"
        shutil.rmtree(src, ignore_errors=True)
        write_random_hf_checkpoint(cfg, src, quantization=quant, max_shard_bytes=1 << 30)
        src_bytes = _du(src)
        for dtype in ("float8", "bfloat16"):
            out = work / f"ck{layers}-{dtype}"
            shutil.rmtree(out, ignore_errors=True)
            load0 = _load()
            secs, rss = _run("convert", ["--hf-dir", str(src), "--out", str(out), "--dtype", dtype])
            rows.append({"command": "ling-convert", "layers": layers, "dtype": dtype, "source_GB": src_bytes / 1e9,
                         "output_GB": _du(out) / 1e9, "largest_tensor_MB": largest / 1e6, "seconds": secs,
                         "GB_per_s": src_bytes / 1e9 / secs, "peak_rss_MB": rss / 1e6,
                         "load_avg_before": load0, "load_avg_after": _load()})
            print(json.dumps(rows[-1]), flush=True)
            if dtype == "float8":
                hf = work / f"hf{layers}"
                shutil.rmtree(hf, ignore_errors=True)
                load0 = _load()
                secs, rss = _run("export", ["--checkpoint", str(out), "--out", str(hf)])
                rows.append({"command": "ling-export", "layers": layers, "dtype": "float8 (auto)",
                             "source_GB": _du(out) / 1e9, "output_GB": _du(hf) / 1e9,
                             "largest_tensor_MB": largest / 1e6, "seconds": secs, "GB_per_s": _du(out) / 1e9 / secs,
                             "peak_rss_MB": rss / 1e6, "load_avg_before": load0, "load_avg_after": _load()})
                print(json.dumps(rows[-1]), flush=True)
                shutil.rmtree(hf)
            shutil.rmtree(out)
        shutil.rmtree(src)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "bench/convert.py",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "processor": platform.processor(),
                   "disk_write_GB_per_s": disk,
                   "note": "host CPU and local disk only; GB/s = source bytes / wall time of the call"},
        "versions": {"python": platform.python_version(), **{p: version(p) for p in
                                                               ("jax", "orbax-checkpoint", "tensorstore", "numpy")}},
        "model": "checkpoint.synthetic.scaled_config(layers): hidden 1024, vocab 32768, 32 experts of width 1024, "
                 "block-FP8 128x128 (embedding, head, router, b_proj excluded)",
        "results": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["versions"]))


if __name__ == "__main__":
    main()
