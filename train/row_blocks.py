"""A checkpoint leaf written a block of rows at a time: ``RowBlocks`` and its orbax handler.

A host embedding table can be most of a machine's memory (a 90 GB table), and training
changes it in place. orbax saves a numpy leaf by first copying it (``NumpyHandler``'s
``deepcopy_host_arrays``, so that later changes cannot reach the file), and a caller
that hands it a view of a live array must copy it too: a save then holds a second
whole table (with the caller's copy, a third). A ``RowBlocks`` leaf is instead read
``read(lo, hi)`` a block of rows at a time, ``IN_FLIGHT`` blocks being written at once
(one read or gathered while the other is written: the per-block commit's latency, not
the bytes, is most of a small table's save), so the save holds two blocks (each at
most ``BLOCK_BYTES`` and a sixteenth of the array: ``block_rows``) and tensorstore's
buffers for them besides the array itself, whatever its size. The price: what ``read``
returns must not change until the save has committed, so
``jaxpar.train.checkpoints.Checkpoints.save`` returns only then (the dense state, small,
is written by then too), where an async save of copies returned once copied.

Measured (2 cores, ocdbt on local disk, a table of 16 float32s a row and its Adagrad
state): 2 GiB: 0.26 GiB more resident while saving (copies: 4.25 GiB), the step
waiting 12 s (copies: 12 s to copy, 29 s until written); the dlrm preset's 12 MiB:
0.12 s (copies: 0.04 s, 0.13 s until written).

On disk it is orbax's numpy array (``typestr`` ``np.ndarray``; zarr, one zarr shard a
block), restored by ``NumpyHandler`` into a numpy target like any other.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp

try:  # orbax's internals the block writer needs (orbax-checkpoint 0.12.8 here)
    import tensorstore as ts
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils as ts_utils
    WRITER = True
except ImportError:  # another orbax: a save reads each RowBlocks leaf whole (a copy), as before
    WRITER = False

BLOCK_BYTES = 64 << 20  # the most a block holds: a few tenths of a second of a disk's writing
MIN_BLOCKS = 16  # and at most this fraction of the array, so a small table is cut too
IN_FLIGHT = 2  # blocks written at once: one is read (gathered) while the other is written


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """A ``shape`` array of ``dtype`` a save reads ``read(lo, hi)`` (its rows ``lo..hi``
    along axis 0, numpy: a view or a gathered copy of those rows alone)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[int, int], np.ndarray]

    def whole(self) -> np.ndarray:
        """All the rows, read at once (a copy): where this orbax has no block writer."""
        return np.array(self.read(0, self.shape[0]), self.dtype)

    @classmethod
    def of(cls, array: np.ndarray) -> "RowBlocks":
        """An array's rows, sliced (views: no copy)."""
        return cls(tuple(array.shape), array.dtype, lambda lo, hi: array[lo:hi])

    def __post_init__(self):
        if not self.shape or self.shape[0] < 1:
            raise ValueError(f"RowBlocks: shape {self.shape} has no rows")


def block_rows(shape: tuple[int, ...], dtype) -> int:
    """Rows a block holds: at most ``BLOCK_BYTES`` and ``1/MIN_BLOCKS`` of the rows."""
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
    return max(1, min(-(-shape[0] // MIN_BLOCKS), BLOCK_BYTES // max(row_bytes, 1)))


class RowBlocksHandler(ocp.type_handlers.NumpyHandler):
    """orbax's ``NumpyHandler`` for ``RowBlocks``: writes each block as one zarr shard,
    reading the next once at most ``IN_FLIGHT - 1`` are still being written; the leaves
    at once. Restores are ``NumpyHandler``'s (same
    ``typestr``: list it before ``np.ndarray``'s handler in a registry, so that the
    ``typestr`` names that one)."""

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        return [future.CommitFutureAwaitingContractedSignals(self._write(values, infos, args),
                                                             name="row_blocks_handler")]

    async def _write(self, values, infos, args) -> None:
        await asyncio.gather(*(self._write_one(v, i, a) for v, i, a in zip(values, infos, args, strict=True)))

    async def _write_one(self, value: RowBlocks, info, arg) -> None:
        await info.await_path_creation()
        if multihost.process_index() != 0:
            return  # a numpy leaf is the same on every process: the first writes it
        rows = block_rows(value.shape, value.dtype)
        spec = ts_utils.build_array_write_spec(
            info=info, arg=arg, global_shape=value.shape, local_shape=(rows, *value.shape[1:]),
            dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(
                use_ocdbt=info.is_ocdbt_checkpoint, override_ocdbt_process_id=self._override_ocdbt_process_id),
            metadata_key=self._metadata_key)
        store = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
        writing = collections.deque()
        for lo in range(0, value.shape[0], rows):
            hi = min(lo + rows, value.shape[0])
            block = np.asarray(value.read(lo, hi), value.dtype)
            if block.shape != (hi - lo, *value.shape[1:]):
                raise ValueError(f"RowBlocks.read({lo}, {hi}) gave shape {block.shape}, expected "
                                 f"{(hi - lo, *value.shape[1:])}")
            writing.append(store[lo:hi].write(block))
            del block  # held by its write alone, until written
            if len(writing) == IN_FLIGHT:
                await writing.popleft()
        for write in writing:
            await write
