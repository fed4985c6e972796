"""What the decode gemv's RMSNorm prologue (`expert_gemv.NormedRows`) costs against plain rows.

    python3 bench/experiments/normed_gemv.py --out $OUT/normed_gemv_h200.json   # the GPU run
    python3 bench/experiments/normed_gemv.py --smoke --out /tmp/normed_gemv.json         # CPU (interpreter)

A batch-1 decode step leaves each layer's RMSNorms to the gemv kernels that read the normed row
(`layer_gemv.normed`): every program scales its tile of the row by the row's 1 / RMS. A chain of
`--layers` products per weight shape, each layer's weight its own slice of a stack larger than the
L2, and each product's rows taken from the one before, with the row given to the kernel three ways:

    plain     x in bf16, no norm (the product alone)
    normed    `normed_rows(x, norm weights, layer)`: the row's sum of squares reduced by XLA, the
              norm applied by the kernel's prologue (the decode step's form)
    xla_norm  `rms_norm(x)` by XLA, then the plain product

Per form: device span per layer and the gemv kernel's mean time from a profiler trace; `normed`
also its output's relative L2 distance from `xla_norm`'s (the same math).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import machine, median_time, write_json
from bench.device_profile import kernel_profile, print_row
from ling_jax.ops import expert_gemv
from ling_jax.ops.expert_gemv import normed_rows

FORMS = ("plain", "normed", "xla_norm")
SHAPES = ((1536, 10240), (1536, 9216), (2048, 1536))  # Ling-3.0-tiny: KDA input, MoE gate|up, o_proj [C, O]
EPS = 1e-6


def chain(x_O: jax.Array, stack_LCO: jax.Array, norm_LC: jax.Array, *, form: str, interpret: bool) -> jax.Array:
    """`--layers` products, each on the row the one before produced (tiled to C): [O] float32."""
    layers, c, _ = stack_LCO.shape
    for i in range(layers):
        x_1C = jnp.tile(x_O[:128], c // 128)[None].astype(stack_LCO.dtype)
        rows = normed_rows(x_1C, norm_LC, jnp.int32(i), EPS)
        x_in = {"plain": x_1C, "normed": rows, "xla_norm": rows.value()}[form]
        y_O = expert_gemv.gathered_products(x_in, jnp.full((1,), i, jnp.int32), (stack_LCO,), interpret=interpret)[0][0]
        x_O = y_O / (1.0 + jnp.max(jnp.abs(y_O)))
    return x_O


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stack-mb", type=float, default=500.0, help="bytes of weights per chain (more than the L2)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="small sizes, the interpreter (CPU check)")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu" and not args.smoke
    result: dict[str, Any] = {**machine(), "runs": []}
    for c, o in ((256, 512),) if args.smoke else SHAPES:
        layers = 2 if args.smoke else max(4, int(args.stack_mb * 1e6 // (c * o * 2)))
        stack = jax.random.normal(jax.random.key(0), (layers, c, o), jnp.bfloat16) * c ** -0.5
        norm = 1 + 0.1 * jax.random.normal(jax.random.key(2), (layers, c), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(1), (o,), jnp.float32)
        outs = {}
        for form in FORMS:
            call = functools.partial(jax.jit(functools.partial(chain, form=form, interpret=not gpu)), x, stack, norm)
            outs[form] = call()
            row: dict[str, Any] = {"dims": [c, o], "layers": layers, "form": form,
                                   "wall_us": median_time(call, reps=args.reps if gpu else 1) * 1e6}
            if form == "xla_norm":
                diff = jnp.linalg.norm(outs["normed"] - outs[form]) / jnp.linalg.norm(outs[form])
                result["runs"][-1]["rel_l2_vs_xla_norm"] = float(diff)
            prof = kernel_profile(call) if gpu else None
            if prof:
                gemv = [k for k in prof["top_kernels"] if k["name"].startswith("expert_gemv")]
                row |= {"span_us_per_layer": prof["span_s_per_call"] * 1e6 / layers,
                        "kernels_per_layer": prof["kernels_per_call"] / layers,
                        "gemv_mean_us": gemv[0]["mean_us"] if gemv else None}
            result["runs"].append(row)
            print_row(row)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
