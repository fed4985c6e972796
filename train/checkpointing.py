"""Orbax checkpoints of a training run: state (params, optimizer state, step), data iterator, metadata.

`CheckpointManager` with asynchronous saves and keep-last-N. Restoring takes the abstract state
(shapes, dtypes and target shardings) so every array comes back directly in its sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


def has_checkpoint(out_dir: str | Path) -> bool:
    """Whether the run directory `out_dir` holds a committed checkpoint step (Orbax renames a step's
    temporary directory to the bare step number when the step is complete)."""
    steps = Path(out_dir) / "checkpoints"
    return steps.is_dir() and any(p.name.isdigit() and p.is_dir() for p in steps.iterdir())


class RunCheckpoints:
    """The checkpoints of one run under `<out>/checkpoints`."""

    def __init__(self, out_dir: str | Path, *, keep: int, async_save: bool = True):
        self.dir = Path(out_dir).resolve() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True, cleanup_tmp_directories=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any], data_state: dict[str, int], meta: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))

    def restore(self, abstract_state: dict[str, Any], step: int | None = None
                ) -> tuple[dict[str, Any], dict[str, int], dict[str, Any]]:
        step = self.latest_step() if step is None else step
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return out["state"], out["data"], out["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
