"""Orbax checkpoints of a training run: parameters, optimizer state, step, loader state.
Generation restores the parameters alone (``restore_params``).

Saves are asynchronous; the last ``keep`` are kept; a save that does not happen raises
``CheckpointError``. Restoring takes the target's shardings, so a checkpoint written on
one mesh restores on another (elastic restarts), and their memory kinds, so one written
with host-resident state (``jaxpar.offload``: ``memory_kind="pinned_host"``) restores onto
the device and the reverse: placement is a plan, not part of the checkpoint. Orbax
copies each addressable shard to the file from where it lives and reads each straight
into the target's memory kind (``orbax/checkpoint/_src/serialization``:
``replica_slices.transfer_arrays_to_host``, ``serialization._read_array_index_and_device_put``),
so host-resident state never passes through device memory, provided the save is not
replica-parallel (``Checkpoints(replica_parallel=False)``, what a run whose state lives
on the host opens).

A ``jaxpar.train.row_blocks.RowBlocks`` leaf (a host embedding table) is written a
block of rows at a time from the live array, never copied whole, and its save returns
once written.

A checkpoint that cannot be read (half-written, corrupt) is skipped with one log line
naming its step and why, and the previous one is used; training (``restore_latest``)
moves it aside to ``checkpoints/corrupt/<step>`` (never deletes it), so the retrained
step can be saved again. Opening a run's checkpoints creates no directory; the first
save does.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.train import row_blocks
from jaxpar.train.row_blocks import RowBlocks, RowBlocksHandler

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that should have been written was not."""


_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step directory being written


def _remove_unfinished_saves(directory: pathlib.Path) -> None:
    """Removes ``<step>.orbax-checkpoint-tmp*`` directories (a save cut short by SIGKILL or
    a second Ctrl-C), which no restore can read; on process 0, as orbax does."""
    if jax.process_index() != 0 or not directory.is_dir():
        return
    for path in directory.glob(f"*{_TMP_SUFFIX}*"):
        log.info("removing unfinished checkpoint save %s", path)
        shutil.rmtree(path, ignore_errors=True)


def _state_handler(replica_parallel: bool) -> ocp.PyTreeCheckpointHandler:
    """orbax's handler for the train state, its arrays written replica-parallel or not.

    Replica-parallel (orbax's default) has each replica of a replicated array write a
    slice of it, and slicing an array held in host memory makes the slice in device
    memory (JAX computes on the device): a save of data-parallel host-resident state
    would hold 1/R of it on every device until written. ``False`` writes each array from
    its first replica, straight from where it lives."""
    array = ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)
    scalar = ocp.type_handlers.ScalarHandler()
    # RowBlocks before np.ndarray: their typestr is the same, and the last names the restorer
    blocks = ((RowBlocks, RowBlocksHandler()),) if row_blocks.WRITER else ()
    registry = ocp.type_handlers.create_type_handler_registry(
        (int, scalar), (float, scalar), (np.number, scalar), *blocks,
        (np.ndarray, ocp.type_handlers.NumpyHandler()), (jax.Array, array))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpoints:
    """A run's checkpoints; ``replica_parallel=False`` for state that lives in host
    memory (``_state_handler``).

    ``replica_parallel=None`` (the default): replica-parallel where the job has more than
    one process, whose hosts then share the writing of replicated arrays. In one process
    every replica lives on the same host and the slicing only costs: orbax slices each
    replicated array on each of its devices, a compiled program per array shape and
    device (72 of the 87 programs a two-step data=8 run of the ``tiny`` preset compiled,
    all for its one save, 2026-11-29), for the same bytes written."""

    def __init__(self, run_dir: str | pathlib.Path, *, keep: int, replica_parallel: bool | None = None):
        if replica_parallel is None:
            replica_parallel = jax.process_count() > 1
        self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
        # create=False: a run that fails before its first save leaves no empty directory.
        # Unfinished saves are removed here, synchronously: orbax's own cleanup
        # (cleanup_tmp_directories) runs in a thread that its close() does not wait for
        # (orbax-checkpoint 0.12), and that thread then races interpreter shutdown.
        _remove_unfinished_saves(self.directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                               create=False)
        # Orbax logs an error of its own for each unparsable file it meets listing and
        # restoring steps: held back until a restore has tried them (_release_logs).
        self._held_logs: list[logging.LogRecord] = []
        self._closed = False
        with _holding_orbax_logs(self._held_logs):
            self.manager = ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={"state": _state_handler(replica_parallel), "meta": ocp.JsonCheckpointHandler()})

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts an async save of ``state`` (a pytree of arrays) and ``meta`` (JSON);
        where ``state`` has ``RowBlocks`` leaves (read while they are written), returns
        once it is written.

        Raises ``CheckpointError`` if orbax declines it (it skips a step at or before
        its latest, readable or not)."""
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        blocks = any(isinstance(leaf, RowBlocks) for leaf in jax.tree.leaves(state))
        if blocks and not row_blocks.WRITER:  # this orbax lacks what the block writer uses: copies
            state = jax.tree.map(lambda x: x.whole() if isinstance(x, RowBlocks) else x, state)
            blocks = False
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta))
        if not self.manager.save(step, args=args):
            raise CheckpointError(
                f"checkpoint at step {step} was not saved to {self.directory} "
                f"(its latest step is {self.manager.latest_step()})"
            )
        if blocks:
            self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_latest(self, abstract_state) -> tuple[int, dict, dict] | None:
        """``(step, state, meta)`` of the newest readable checkpoint, or None if none;
        unreadable newer ones are moved to ``corrupt/<step>``.

        ``abstract_state`` gives shapes, dtypes and the shardings to restore onto.
        """
        args = ocp.args.Composite(state=_restore_args(abstract_state), meta=ocp.args.JsonRestore())
        found = self._restore_newest(args, move_aside=True)
        return None if found is None else (found[0], found[1]["state"], found[1]["meta"])

    def restore_params(self, abstract_params, step: int | None = None) -> tuple[int, object] | None:
        """``(step, params)`` of the newest readable checkpoint (or of ``step``'s), or None
        if none: its ``params`` subtree alone (orbax's partial restore), the optimizer
        state (twice the parameters' bytes under AdamW) never read. ``abstract_params``
        gives shapes, dtypes and shardings. Reads only: an unreadable checkpoint is
        skipped where it lies.

        Raises:
          ValueError: no checkpoint of ``step`` (naming the steps there are)."""
        args = ocp.args.Composite(state=_restore_args({"params": abstract_params}, partial=True))
        if step is not None:
            if step not in self.steps():
                raise ValueError(f"no checkpoint of step {step} in {self.directory} (steps there: "
                                 f"{self.steps()})")
            try:
                with _holding_orbax_logs(self._held_logs):
                    restored = self.manager.restore(step, args=args)
            finally:
                self._release_logs([])
            return step, restored["state"]["params"]
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
        # (a save thread still running then prints "cannot schedule new futures").
        # Not on KeyboardInterrupt: a second Ctrl-C leaves at once, save or no save.
        if kind is None or not issubclass(kind, KeyboardInterrupt):
            self.close()


def _restore_args(target, *, partial: bool = False) -> ocp.args.PyTreeRestore:
    """Restores ``target``'s leaves (abstract arrays) onto their shardings, memory kinds
    included; ``partial``: only the subtrees ``target`` has."""
    return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=partial)


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
