"""Orbax checkpoints of a training run: parameters, optimizer state, step, loader state.
Generation restores the parameters alone (``restore_params``).

Saves are asynchronous; the last ``keep`` are kept; a save that does not happen raises
``CheckpointError``. Restoring takes the target's shardings, so a checkpoint written on
one mesh restores on another (elastic restarts), and their memory kinds, so one written
with host-resident state (``jaxpar.offload``: ``memory_kind="pinned_host"``) restores onto
the device and the reverse: placement is a plan, not part of the checkpoint. Orbax
copies each addressable shard to the file from where it lives and reads each straight
into the target's memory kind, so host-resident state never passes through device
memory (``orbax/checkpoint/_src/serialization``: ``replica_slices.transfer_arrays_to_host``,
``serialization._read_array_index_and_device_put``); it needs nothing of ours for that. A checkpoint that cannot be read
(half-written, corrupt) is skipped with one log line naming its step and why, and the
previous one is used; training (``restore_latest``) moves it aside to
``checkpoints/corrupt/<step>`` (never deletes it), so the retrained step can be saved
again. Opening a run's checkpoints creates no directory; the first save does.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import shutil

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that should have been written was not."""


class Checkpoints:
    def __init__(self, run_dir: str | pathlib.Path, *, keep: int):
        self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
        # create=False: a run that fails before its first save leaves no empty directory.
        # cleanup_tmp_directories: a save cut short (SIGKILL, a second Ctrl-C) leaves a
        # `<step>.orbax-checkpoint-tmp` directory that no restore can read.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                               create=False, cleanup_tmp_directories=True)
        # Orbax logs an error of its own for each unparsable file it meets listing and
        # restoring steps: held back until a restore has tried them (_release_logs).
        self._held_logs: list[logging.LogRecord] = []
        self._closed = False
        with _holding_orbax_logs(self._held_logs):
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts an async save of ``state`` (a pytree of arrays) and ``meta`` (JSON).

        Raises ``CheckpointError`` if orbax declines it (it skips a step at or before
        its latest, readable or not)."""
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if not self.manager.save(step, args=args):
            raise CheckpointError(
                f"checkpoint at step {step} was not saved to {self.directory} "
                f"(its latest step is {self.manager.latest_step()})"
            )

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_latest(self, abstract_state) -> tuple[int, dict, dict] | None:
        """``(step, state, meta)`` of the newest readable checkpoint, or None if none;
        unreadable newer ones are moved to ``corrupt/<step>``.

        ``abstract_state`` gives shapes, dtypes and the shardings to restore onto.
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                  meta=ocp.args.JsonRestore())
        found = self._restore_newest(args, move_aside=True)
        return None if found is None else (found[0], found[1]["state"], found[1]["meta"])

    def restore_params(self, abstract_params) -> tuple[int, object] | None:
        """``(step, params)`` of the newest readable checkpoint, or None if none: its
        ``params`` subtree alone (orbax's partial restore), the optimizer state (twice the
        parameters' bytes under AdamW) never read. ``abstract_params`` gives shapes, dtypes
        and shardings. Reads only: an unreadable checkpoint is skipped where it lies."""
        target = {"params": abstract_params}
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))
        found = self._restore_newest(args, move_aside=False)
        return None if found is None else (found[0], found[1]["state"]["params"])

    def _restore_newest(self, args: ocp.args.Composite, *, move_aside: bool
                        ) -> tuple[int, ocp.args.Composite] | None:
        """``(step, restored)`` for the newest checkpoint ``args`` restores, skipping any
        that cannot be read (one log line each), moved aside if ``move_aside``."""
        skipped = []
        try:
            for step in reversed(self.steps()):
                try:
                    with _holding_orbax_logs(self._held_logs):
                        return step, self.manager.restore(step, args=args)
                except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                    skipped.append(step)
                    with _holding_orbax_logs(self._held_logs):
                        where = self._move_aside(step) if move_aside else None
                    log.warning("checkpoint at step %d in %s cannot be restored (%s)%s; trying the previous one",
                                step, self.directory, _reason(e),
                                f"; moved to {where.relative_to(self.directory.parent)}" if where else "")
            return None
        finally:
            self._release_logs(skipped)

    def _release_logs(self, skipped: list[int]) -> None:
        """Logs the orbax records held back but those about the ``skipped`` steps (their
        one line says why each was skipped)."""
        about = [f"{self.directory / str(step)}/" for step in skipped]
        held, self._held_logs[:] = list(self._held_logs), []
        for record in held:
            if not any(path in record.getMessage() for path in about):
                logging.getLogger("absl").handle(record)

    def _move_aside(self, step: int) -> pathlib.Path:
        """Moves step ``step``'s directory to ``corrupt/<step>`` (``<step>-2`` ... when an
        earlier one of that step is there) and returns where; every process agrees first
        and the lead moves (the checkpoint directory is shared)."""
        corrupt = self.directory / "corrupt"
        where, n = corrupt / str(step), 1
        while where.exists():
            n += 1
            where = corrupt / f"{step}-{n}"
        _barrier(f"jaxpar checkpoint {step} unreadable")
        if jax.process_index() == 0:
            corrupt.mkdir(exist_ok=True)
            shutil.move(self.directory / str(step), where)
        _barrier(f"jaxpar checkpoint {step} moved")
        self.manager.reload()
        return where

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight and stops orbax's threads (again: a no-op)."""
        if self._closed:
            return
        self._closed = True
        self._release_logs([])
        self.manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        # Closed on every way out: a manager left open races interpreter shutdown
        # (its background cleanup thread then prints "cannot schedule new futures").
        # Not on KeyboardInterrupt: a second Ctrl-C leaves at once, save or no save.
        if kind is None or not issubclass(kind, KeyboardInterrupt):
            self.close()


@contextlib.contextmanager
def _holding_orbax_logs(held: list[logging.LogRecord]):
    """Holds back orbax's log records (absl's logger) in ``held`` for the block."""
    absl = logging.getLogger("absl")
    absl.addFilter(held.append)  # returns None: the record is not logged
    try:
        yield
    finally:
        absl.removeFilter(held.append)


def _barrier(name: str) -> None:
    """Waits for every process (nothing to wait for, and no program to compile, in one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _reason(error: Exception) -> str:
    """The innermost cause's type and its first line, whole."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [l.strip() for l in str(cause).splitlines() if l.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
