"""Speed-proportional batches across unequal processes (HetSeq): ``data.batch_weights``.

Each process takes a share of every global batch proportional to its weight, and the
step's loss and gradients are the homogeneous run's over the same global batch: the
token-weighted mean over all its rows, whichever process read them.

How one SPMD program gives unequal processes unequal work: every data-parallel device
has a slot of ``slot`` rows in the step's global batch (the most any device reads), its
real rows first, the rest padding (mask 0). Under ``shard_map`` over the data axis (the
step's per-replica part, ``jaxpar.train.gradients.over_replicas`` with ``rows``) each
device runs its own rows in microbatches of ``unit`` rows, as many as it has real rows
for (a ``fori_loop`` whose trip count is the device's own, read from its mask: the last
row with a counted token), summing each microbatch's loss and gradients times its
counted tokens; one ``psum`` over the data axes, then division by the batch's counted
tokens, gives the global token-weighted mean. A process with a quarter of the rows
computes a quarter of the microbatches and then waits at the ``psum``: what a slow
process costs the others is gone when its weight matches its speed.

Weights become row counts (``row_counts``): each process's rows are a whole number of
``quantum`` rows per local device (a quarter of the even share, or one row), at least
one quantum, summing to the global batch; a device runs its rows a quantum at a time
(``unit``), so new weights change the slot (the batch's shape) but not the program's
microbatch.

``auto`` (``measure``): a few timed forward/backward passes of one microbatch on each
process's first device give its tokens/s; the processes share them
(``process_allgather``) and every process derives the same weights. With
``data.rebalance_every=N`` the trainer re-measures every ``N`` steps (a ``Trainer``
hook); a new slot size compiles the step anew, once per distinct split.

With ``mesh.fsdp`` or ``mesh.tensor`` a "device" above is a data replica: its slot's
rows split over its FSDP devices (a quantum is a multiple of ``mesh.fsdp``), and every
device of the replica runs the replica's loop as many times, so the FSDP and tensor
collectives inside it stay within the replica (per-group all-gathers and reductions;
replicas with fewer rows leave the loop earlier). With ``optimizer.grad_accum=k`` the
loop is the accumulation: its microbatches are ``unit / k`` rows. Limits, stated: no
``mesh.pipe`` or ``mesh.seq`` (their collective-permutes meet every device at once, so a
loop of a replica's own length deadlocks: seen on CPU), the same number of devices in
every process, and a language model (``task: lm``); refused when the config
is read (``jaxpar.train.combinations``). With ``optimizer.reduction=adasum`` or
``optimizer.compression=dct_topk`` each device's token-weighted mean over its own real
rows is what the replicas combine (Adasum's, or the top-k exchange's mean), in place of
the global token-weighted mean.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax
import numpy as np

from jaxpar.inputs import InputError
from jaxpar.placement.sharding import use_mesh
from jaxpar.train import data as data_lib
from jaxpar.train.config import Config, ConfigError
from jaxpar.train.trainer import StepInfo

log = logging.getLogger(__name__)


class WeightsError(InputError):
    """Weights that cannot split a batch; the CLI prints the line and exits 2."""


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """How a global batch splits over processes: ``rows[p]`` of process ``p``,
    ``devices`` data-parallel devices per process, each device's ``slot`` rows in the
    step's global batch (real rows first), run in microbatches of ``unit`` rows (a
    divisor of every device's rows); ``within``: ``mesh.fsdp`` times
    ``optimizer.grad_accum``, which divides ``unit``."""

    rows: tuple[int, ...]
    devices: int
    unit: int
    within: int = 1

    @property
    def device_rows(self) -> tuple[int, ...]:
        return tuple(r // self.devices for r in self.rows)

    @property
    def slot(self) -> int:
        return max(self.device_rows)

    def padded(self, local: dict, process: int) -> dict:
        """Process ``process``'s ``local`` rows ``[rows[process], T]`` as its part of the
        step's batch, ``[devices * slot, T]``: each device's rows then zero rows."""
        per, slot = self.device_rows[process], self.slot

        def pad(x):
            x = x.reshape(self.devices, per, *x.shape[1:])
            widths = [(0, 0), (0, slot - per)] + [(0, 0)] * (x.ndim - 2)
            return np.pad(x, widths).reshape(self.devices * slot, *x.shape[2:])

        return {k: pad(v) for k, v in local.items()}


def row_counts(global_batch: int, weights, processes: int, devices: int, within: int = 1) -> RowSplit:
    """The ``RowSplit`` that splits ``global_batch`` rows over ``processes`` processes of
    ``devices`` data-parallel devices (replicas) each, in proportion to ``weights``
    (largest remainders, in quanta: the largest divisor of a replica's even share up to a
    quarter of it, a multiple of ``within``: ``mesh.fsdp`` (the devices a replica's rows
    split over) times ``optimizer.grad_accum`` (the microbatches a quantum is run in))."""
    weights = tuple(float(w) for w in weights)
    if len(weights) != processes:
        raise WeightsError(f"data.batch_weights={list(weights)} has {len(weights)} entries for "
                           f"{processes} processes: give one weight per process")
    if any(not w > 0 or not math.isfinite(w) for w in weights):
        raise WeightsError(f"data.batch_weights={list(weights)}: every weight must be positive")
    even = global_batch // (processes * devices)
    if even < 1 or global_batch % (processes * devices):
        raise WeightsError(f"batch_size={global_batch} is not divisible by the {processes * devices} "
                           "data-parallel devices")
    if even % within:
        raise WeightsError(f"batch_size={global_batch} gives each of the {processes * devices} data replicas "
                           f"{even} rows, which microbatches of a multiple of {within} rows (mesh.fsdp x "
                           "optimizer.grad_accum) cannot split")
    quantum = max(q for q in range(within, even + 1, within) if even % q == 0 and q <= max(within, even // 4))
    units = global_batch // (devices * quantum)
    exact = np.array(weights) / sum(weights) * units
    counts = np.maximum(np.floor(exact).astype(int), 1)
    while counts.sum() > units:  # the floors of 1 took more than there is
        counts[np.argmax(counts - exact)] -= 1
    order = np.argsort(-(exact - counts), kind="stable")
    for i in range(units - counts.sum()):
        counts[order[i % processes]] += 1
    return RowSplit(tuple(int(c) * devices * quantum for c in counts), devices, quantum, within)


def measure(step_fn, params, rows: dict, *, repeats: int = 3) -> float:
    """This process's tokens/s: the median of ``repeats`` timed forward/backward passes
    of ``rows`` (one microbatch, numpy ``[unit, T]``) on its first device, times its
    data-parallel devices (compiled once before timing)."""
    device = jax.local_devices()[0]
    alone = jax.make_mesh((1,), ("data",), devices=[device], axis_types=(jax.sharding.AxisType.Auto,))
    local = jax.device_put(jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params), device)
    batch = jax.device_put(rows, device)
    grad = jax.jit(jax.value_and_grad(lambda p, b: step_fn.loss(step_fn.model(p), b)))
    times = []
    with use_mesh(alone):  # this device alone, whatever mesh the run is under
        jax.block_until_ready(grad(local, batch))
        for _ in range(repeats):
            began = time.perf_counter()
            jax.block_until_ready(grad(local, batch))
            times.append(time.perf_counter() - began)
    tokens = rows["inputs"].size
    return tokens / float(np.median(times)) * len(jax.local_devices())


def shared_speeds(speed: float) -> tuple[float, ...]:
    """Every process's ``speed``, in process order, the same on every process."""
    if jax.process_count() == 1:
        return (speed,)
    from jax.experimental import multihost_utils

    return tuple(float(s) for s in np.asarray(multihost_utils.process_allgather(np.float64(speed))).ravel())


def row_split_of(cfg: Config, mesh) -> RowSplit | None:
    """With ``data.batch_weights``, how each global batch splits over the processes
    (``auto``: evenly until measured); ``ConfigError`` (exit 2) where the weights do not
    fit the run. The features it does not compose with (the limits above) are refused
    when the config is read (``jaxpar.train.combinations``)."""
    weights = cfg.data.batch_weights
    if weights is None:
        return None
    processes = jax.process_count()
    try:
        return row_counts(cfg.batch_size, (1.0,) * processes if weights == "auto" else weights,
                          processes, mesh.shape["data"] // processes,
                          mesh.shape.get("fsdp", 1) * cfg.layout.grad_accum)
    except WeightsError as e:
        raise ConfigError(str(e)) from None


def rebalancing(cfg: Config, step_fn, row_split: RowSplit, data):
    """A ``Trainer`` hook: measures every process's tokens/s (``measure``), shares the
    next batches (``data``, the trainer's ``Batches``) in proportion and records the new
    shares in the step's metrics (``batch_shares``)."""

    def rebalance(info: StepInfo) -> None:
        rows = data.loader.local_rows(data.loader.step)[:row_split.unit]
        speeds = shared_speeds(measure(step_fn, info.params, data_lib.batch_of_rows(data.loader.rows, rows)))
        data.share(row_counts(cfg.batch_size, speeds, len(speeds), row_split.devices, row_split.within))
        if info.record is not None:
            info.record["batch_shares"] = list(data.row_split.rows)
        log.info("batch shares %s from tokens/s %s", list(data.row_split.rows), [round(s) for s in speeds])

    return rebalance


def start_shares(cfg: Config, step_fn, row_split: RowSplit, data, trainer, *, resumed: bool) -> None:
    """The shares the run starts with: a list's; with ``auto``, the checkpoint's where it
    saved some for as many processes, else measured before the first step."""
    saved = data.loader.saved_shares if resumed else None
    if cfg.data.batch_weights != "auto":
        data.share(row_split)
    elif saved is not None and len(saved) == jax.process_count() and sum(saved) == cfg.batch_size:
        data.share(dataclasses.replace(row_split, rows=saved))
    else:
        data.share(row_split)
        with step_fn.context():
            rebalancing(cfg, step_fn, row_split, data)(StepInfo(0, trainer.params, trainer.opt_state, None, {}, False))
