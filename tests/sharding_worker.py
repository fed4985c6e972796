"""One process of test_sharding.py's two-process test, and the computation both sides compare.

    python tests/sharding_worker.py PROCESS_ID PORT OUT.npz

joins a 2-process job on localhost (4 simulated CPU devices each, gloo collectives), loads the
golden SET A checkpoint onto a data=2 x expert=4 mesh spanning both processes, assembles the
input batch from per-process rows (`distributed.global_batch`), and runs `step` — logits, loss,
gradients and the loss after one SGD step. Process 0 writes the results to OUT.npz.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

GOLDEN_A = Path(__file__).resolve().parent / "golden" / "ling3_tiny_a"
LR = 0.5


def next_token_loss(cfg, params, ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean negative log-likelihood of the next tokens, logits [B, T, V])."""
    from ling_jax.model import forward_hidden, lm_head

    logits_BTV = lm_head(cfg, params, forward_hidden(cfg, params, ids_BT)["final"])
    logp = jax.nn.log_softmax(logits_BTV[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1)), logits_BTV


@functools.partial(jax.jit, static_argnums=0)
def step(cfg, params, ids_BT: jax.Array) -> dict:
    """Logits, loss and grads at `params`, and the loss after one SGD step of size LR."""
    (loss, logits), grads = jax.value_and_grad(next_token_loss, argnums=1, has_aux=True)(cfg, params, ids_BT)
    stepped = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    loss_after, _ = next_token_loss(cfg, stepped, ids_BT)
    return {"logits": logits, "loss": loss, "grads": grads, "loss_after": loss_after}


def flat_grads(grads) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(grads)}


def main(argv: list[str]) -> int:
    pid, port, out = int(argv[1]), int(argv[2]), Path(argv[3])
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.experimental import multihost_utils

    import ling_jax
    from ling_jax import distributed
    from ling_jax.sharding import batch_sharding

    assert distributed.initialize(f"localhost:{port}", 2, pid)
    assert jax.process_count() == 2 and jax.device_count() == 8
    mesh = ling_jax.make_mesh(data=2, expert=4)
    cfg, params = ling_jax.load_hf_checkpoint(GOLDEN_A, dtype="float32", mesh=mesh)
    ids = np.load(GOLDEN_A / "golden.npz")["prefill_input_ids"]
    rows = distributed.local_rows(batch_sharding(mesh, ids.shape), ids.shape)
    ids_BT = distributed.global_batch(ids[rows], mesh, global_batch_size=ids.shape[0])
    with jax.set_mesh(mesh):
        out_tree = step(cfg, params, ids_BT)
    host = multihost_utils.process_allgather(out_tree, tiled=True)
    if pid == 0:
        np.savez(out, logits=host["logits"], loss=host["loss"], loss_after=host["loss_after"],
                 rows=np.array([rows.start, rows.stop]), **flat_grads(host["grads"]))
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
