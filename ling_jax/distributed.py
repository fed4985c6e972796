"""Multi-host wiring: joining a multi-process JAX job, and turning per-process batches into global arrays.

The same program runs on one CPU, one GPU, a multi-GPU host or a TPU slice:

    from ling_jax import distributed
    distributed.initialize()            # before anything touches a device; no-op for one process
    mesh = ling_jax.make_mesh(data=..., expert=..., ...)   # over every process's devices
    batch = distributed.global_batch(local_rows, mesh)     # each process passes its own rows

`initialize` takes the coordinator explicitly (`coordinator_address`, `num_processes`,
`process_id`), or from the environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`), or lets JAX detect a cluster it knows (Cloud TPU slices, SLURM, Open MPI,
Kubernetes). With none of these it does nothing: a single process needs no coordinator. On CPU
the cross-process collectives go through gloo (`jax_cpu_collectives_implementation`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ling_jax.sharding import batch_sharding

ENV_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def _cluster_detected() -> bool:
    """Whether JAX's own cluster detection (TPU slice, SLURM, Open MPI, k8s) finds an environment."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - private module moved
        return False
    return any(not env.opt_in_only_method and env.is_env_present() for env in clusters.ClusterEnv._cluster_types)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
               auto_detect: bool = True) -> bool:
    """Joins the multi-process job (`jax.distributed.initialize`); returns True when it did.

    Explicit arguments win over `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`.
    With no coordinator given and `auto_detect`, a cluster JAX recognises is joined; otherwise,
    or with `num_processes == 1`, nothing happens. Call it before any computation.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes == 1:
        return False
    if coordinator_address is None and not (auto_detect and _cluster_detected()):
        if num_processes is not None or process_id is not None:
            raise ValueError(f"num_processes/process_id given but no coordinator address "
                             f"(argument coordinator_address or {ENV_ADDRESS})")
        return False
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError(f"coordinator address {coordinator_address!r} given without num_processes and "
                         f"process_id (arguments or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)
    return True


def local_rows(sharding: NamedSharding, global_shape: Sequence[int]) -> slice:
    """The contiguous rows (axis 0) of a global array of `global_shape` that this process's devices hold.

    A data loader reads exactly these rows of the global batch; `global_batch` then assembles
    them. Raises if the process's rows are not one contiguous block (a mesh whose batch axes
    interleave processes).
    """
    n = global_shape[0]
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(*index[0].indices(n)) if index else range(n))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError(f"this process's rows of a {tuple(global_shape)} batch are not contiguous: {sorted(rows)}")
    return slice(lo, hi)


def global_batch(local: Any, mesh: Mesh, global_batch_size: int | None = None) -> Any:
    """A pytree of per-process arrays [B_local, ...] -> global `jax.Array`s [B, ...] split over the token axes.

    Every leaf is sharded like `sharding.batch_sharding` (rows over data × fsdp × expert). Each
    process passes the rows `local_rows` names for it (its share of the global batch);
    `global_batch_size` defaults to B_local times the number of processes.
    """

    def make(a: Any) -> jax.Array:
        a = np.asarray(a)
        b = global_batch_size if global_batch_size is not None else a.shape[0] * jax.process_count()
        shape = (b, *a.shape[1:])
        sh = batch_sharding(mesh, shape)
        rows = local_rows(sh, shape)
        if a.shape[0] != rows.stop - rows.start:
            raise ValueError(f"process {jax.process_index()} holds rows {rows.start}:{rows.stop} of the global "
                             f"batch {shape} but was given {a.shape[0]} rows")
        return jax.make_array_from_process_local_data(sh, a, shape)

    return jax.tree.map(make, local)
