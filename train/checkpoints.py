"""Orbax checkpoints of a training run: parameters, optimizer state, step, loader state.
Generation restores the parameters alone (``restore_params``).

Saves are asynchronous; the last ``keep`` are kept. Restoring takes the target's
shardings, so a checkpoint written on one mesh restores on another (elastic restarts).
A latest checkpoint that cannot be read (half-written, corrupt) is skipped with a
warning naming its step, and the previous one is used.
"""

from __future__ import annotations

import logging
import pathlib
import warnings

import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpoints:
    def __init__(self, run_dir: str | pathlib.Path, *, keep: int):
        self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts an async save of ``state`` (a pytree of arrays) and ``meta`` (JSON)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args)

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_latest(self, abstract_state) -> tuple[int, dict, dict] | None:
        """``(step, state, meta)`` of the newest readable checkpoint, or None if none.

        ``abstract_state`` gives shapes, dtypes and the shardings to restore onto.
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                  meta=ocp.args.JsonRestore())
        found = self._restore_newest(args)
        return None if found is None else (found[0], found[1]["state"], found[1]["meta"])

    def restore_params(self, abstract_params) -> tuple[int, object] | None:
        """``(step, params)`` of the newest readable checkpoint, or None if none: its
        ``params`` subtree alone (orbax's partial restore), the optimizer state (twice the
        parameters' bytes under AdamW) never read. ``abstract_params`` gives shapes, dtypes
        and shardings."""
        target = {"params": abstract_params}
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))
        found = self._restore_newest(args)
        return None if found is None else (found[0], found[1]["state"]["params"])

    def _restore_newest(self, args: ocp.args.Composite) -> tuple[int, ocp.args.Composite] | None:
        """``(step, restored)`` for the newest checkpoint ``args`` restores, skipping (with
        a warning naming it) any that cannot be read."""
        for step in reversed(self.steps()):
            try:
                return step, self.manager.restore(step, args=args)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                warnings.warn(
                    f"checkpoint at step {step} in {self.directory} cannot be restored "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); trying the previous one",
                    stacklevel=3,
                )
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
