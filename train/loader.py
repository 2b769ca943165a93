"""Shuffled training batches of packed rows: the ``Loader``.

The batch of a step is the samples from its offset on, each a pure function of (seed,
sample offset), sliced for this process; its checkpointable state is a few ints. Batches
are ``jaxpar.train.data.batch_of_rows``' dicts of int32 ``[B, T]`` numpy arrays.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.train.data import PackedRows, _process_slice, batch_of_rows


class Loader:
    """Shuffled training batches; the sample at offset ``i`` (samples consumed before it,
    over the whole run) is a pure function of (seed, i), and step ``s``'s batch is the
    ``global_batch`` samples from its offset on.

    Sample ``i`` belongs to epoch ``i // R`` and is row ``perm_epoch[i % R]``, with
    ``perm_epoch = np.random.default_rng((seed, epoch)).permutation(R)``: every epoch
    visits every row once, and a batch that straddles an epoch end takes the rest from
    the next epoch. Each process computes only its contiguous slice (``global_batch //
    process_count`` rows, process 0 first), so the slices of all processes make the
    global batch.

    The position is a sample offset, not a step, so a run may change its global batch
    between checkpoints (an elastic job): with batch 16 for 10 steps then 32, step 11
    starts at sample 160, and no sample is skipped or repeated. ``origin`` is where this
    loader's batch size took over, ``(step, offset)``; step ``s``'s batch starts at
    ``offset + (s - step) * global_batch``. The state to checkpoint is ``state()``;
    ``restore(state)`` continues with exactly the next sample, on any number of
    processes and at any global batch.
    """

    def __init__(
        self,
        rows: PackedRows,
        global_batch: int,
        *,
        seed: int,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self._local = _process_slice(global_batch, process_index, process_count)
        self.process = jax.process_index() if process_index is None else process_index
        self.shares: tuple[int, ...] | None = None
        if len(rows) < global_batch:
            raise ValueError(
                f"the dataset has {len(rows)} rows, fewer than global_batch={global_batch}"
            )
        self.rows, self.global_batch, self.seed = rows, global_batch, seed
        self.step = 0  # the next step __next__ returns
        self.origin = (0, 0)  # (step, sample offset) where this global_batch took over
        self.saved_shares: tuple[int, ...] | None = None
        self._perms: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(len(self.rows))
        return self._perms[epoch]

    def offset_of(self, step: int) -> int:
        """The sample offset step ``step``'s batch starts at (``step`` at or after ``origin``'s)."""
        first, offset = self.origin
        if step < first:
            raise ValueError(f"step {step} is before step {first}, where this loader's global_batch "
                             f"{self.global_batch} took over: its offset is not this loader's to say")
        return offset + (step - first) * self.global_batch

    @property
    def offset(self) -> int:
        """The samples consumed: the offset of the next batch."""
        return self.offset_of(self.step)

    def sample_rows(self, offset: int, count: int) -> np.ndarray:
        """The row indices ``[count]`` of samples ``offset .. offset + count - 1``."""
        n = len(self.rows)
        i = offset + np.arange(count)
        epochs = i // n
        out = np.empty(count, np.int64)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = self._permutation(int(epoch))[i[at] % n]
        return out

    def row_indices(self, step: int) -> np.ndarray:
        """The global batch's row indices ``[global_batch]`` at ``step``."""
        return self.sample_rows(self.offset_of(step), self.global_batch)

    def share(self, rows: tuple[int, ...] | None) -> None:
        """From now on process ``p`` reads ``rows[p]`` rows of each global batch
        (``data.batch_weights``; process 0 first, in order), or with None an equal slice."""
        if rows is not None and sum(rows) != self.global_batch:
            raise ValueError(f"row shares {list(rows)} do not sum to global_batch={self.global_batch}")
        self.shares = None if rows is None else tuple(int(r) for r in rows)
        if rows is not None:
            lo = sum(rows[:self.process])
            self._local = slice(lo, lo + rows[self.process])

    def local_rows(self, step: int) -> np.ndarray:
        """This process's row indices ``[B]`` of step ``step``'s batch (B = global_batch
        // process_count): the rows ``batch(step)`` holds, in its order."""
        return self.row_indices(step)[self._local]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's slice of step ``step``'s batch: int32 ``[B, T]`` arrays with
        B = global_batch // process_count (see ``batch_of_rows`` for the keys)."""
        return batch_of_rows(self.rows, self.local_rows(step))

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state(self) -> dict[str, int]:
        """The next step, ``origin`` (where this batch size took over) and
        ``global_batch``, from which its sample ``offset`` follows (saved too, for
        readers), plus what must match for the stream to be the same: ``seed`` and
        ``n_rows``."""
        state = {"step": self.step, "origin": list(self.origin), "offset": self.offset, "seed": self.seed,
                 "n_rows": len(self.rows), "global_batch": self.global_batch}
        return state if self.shares is None else {**state, "shares": list(self.shares)}

    def restore(self, state: dict) -> None:
        """Continues from ``state()`` of an earlier loader over the same data, at this
        loader's global batch, which may differ from the saved one: the next batch
        starts at the sample the saved loader would have read next. A state without
        ``origin`` (checkpoints before sample offsets) is at ``step * global_batch``. The
        offset is derived from ``origin`` and ``step`` (the state's ``offset`` is for
        readers), so a state whose ``step`` a caller moves stays consistent. Its row
        shares, where it had them, are ``saved_shares``: the caller decides whether they
        still apply (they sum to the saved global batch)."""
        for name in ("seed", "n_rows"):
            if int(state[name]) != self.state()[name]:
                raise ValueError(
                    f"loader state has {name}={int(state[name])} but this loader has "
                    f"{name}={self.state()[name]}: not the same data stream"
                )
        step, saved_batch = int(state["step"]), int(state["global_batch"])
        first, offset = (int(x) for x in state.get("origin", (0, 0)))
        self.step, self.origin = step, (step, offset + (step - first) * saved_batch)
        self.saved_shares = tuple(state["shares"]) if "shares" in state else None
