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

Over several processes a leaf is either the same on every process (``owned`` None:
process 0 writes it, as orbax writes a numpy leaf) or split: each process writes the
rows ``owned`` says it holds (a split host table: each process's shards), into its own
OCDBT store, which orbax merges once every process is done. Two processes must not
write parts of one zarr chunk (each would write the whole chunk, the other's rows
blank), so a split leaf's chunks divide ``align`` (the gcd of the rows where the
writing process changes; ``chunk_rows``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp

try:  # orbax's internals the block writer needs (orbax-checkpoint 0.12.8 here)
    import tensorstore as ts
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils as ts_utils
    WRITER = True
except ImportError:  # another orbax: a save reads each RowBlocks leaf whole (a copy; ``whole``), as before
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
    # Over several processes: the rows (lo, hi) this process writes (None: every row, by
    # process 0), and a number every writing process's boundary is a multiple of.
    owned: tuple[tuple[int, int], ...] | None = None
    align: int = 0

    def whole(self) -> np.ndarray:
        """All the rows (a copy): where this orbax has no block writer, so that orbax
        saves it as any numpy leaf. Split over processes (``owned``), each block of rows
        is gathered from the processes that hold it (a collective: every process calls
        this; a block's copy per process in flight besides the whole)."""
        if self.owned is None:
            return np.array(self.read(0, self.shape[0]), self.dtype)
        from jax.experimental import multihost_utils

        out = np.empty(self.shape, self.dtype)
        step = block_rows(self.shape, self.dtype)
        for lo in range(0, self.shape[0], step):
            hi = min(lo + step, self.shape[0])
            part, held = np.zeros((hi - lo, *self.shape[1:]), self.dtype), np.zeros(hi - lo, bool)
            for a, b in ((max(a, lo), min(b, hi)) for a, b in self.owned):
                if a < b:
                    part[a - lo:b - lo], held[a - lo:b - lo] = self.read(a, b), True
            parts, helds = (np.asarray(x) for x in multihost_utils.process_allgather((part, held)))
            owner = helds.argmax(0).reshape(1, -1, *[1] * (len(self.shape) - 1))  # the process holding each row
            out[lo:hi] = np.take_along_axis(parts, owner, axis=0)[0]
        return out

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


def chunk_rows(rows: int, align: int) -> int:
    """The largest divisor of ``align`` that is at most ``rows`` (``rows`` itself when
    ``align`` is 0: nothing to align to), so that chunks of it never straddle a multiple
    of ``align``. (A prime ``align`` gives one-row chunks: correct, slower to write.)"""
    if not align:
        return rows
    divisors = {d for i in range(1, math.isqrt(align) + 1) if align % i == 0 for d in (i, align // i)}
    return max(d for d in divisors if d <= rows)


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
        primary = multihost.process_index() == 0
        if value.owned is None and not primary:
            return  # a numpy leaf is the same on every process: the first writes it
        ranges = ((0, value.shape[0]),) if value.owned is None else value.owned
        target = block_rows(value.shape, value.dtype)
        chunk = chunk_rows(target, value.align)
        rows = chunk * (target // chunk)  # a block: whole chunks
        spec = ts_utils.build_array_write_spec(
            info=info, arg=arg, global_shape=value.shape, local_shape=(chunk, *value.shape[1:]),
            dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(
                use_ocdbt=info.is_ocdbt_checkpoint, override_ocdbt_process_id=self._override_ocdbt_process_id),
            metadata_key=self._metadata_key)
        # the metadata by the first process alone (orbax's way with a split jax.Array)
        opened = dict(create=True, open=True) if primary else dict(open=True, assume_metadata=True)
        store = await ts.open(ts.Spec(spec.json), context=info.ts_context, **opened)
        writing = collections.deque()
        for lo, hi in ((lo, min(lo + rows, end)) for start, end in ranges for lo in range(start, end, rows)):
            if lo % chunk:
                raise ValueError(f"RowBlocks: rows from {lo} owned, not a multiple of the chunk's {chunk} rows "
                                 f"(align={value.align})")
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
