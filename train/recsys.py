"""Training a recommendation model: ``jaxpar-train dlrm`` (``task: dlrm``).

``jaxpar.models.DLRM`` on Criteo's TSV or the synthetic Zipf stream
(``jaxpar.train.recsys_data``), data parallel over ``mesh.data``. The model's one
concatenated embedding table lives where ``embedding.*`` says: by default in host memory
with ``embedding.cache_ratio`` of its rows cached on the device (``jaxpar.embedding``),
or (``cache_ratio: null``) whole on the device. Both sit behind one interface, so one
step serves both:

1. the host makes the batch's rows resident and returns their slots (``prepare``; the
   next ``embedding.prefetch`` batches' missing rows are gathered by a host thread
   meanwhile);
2. the jitted step reads ``rows[slots]``, differentiates the loss in the dense
   parameters (``optimizer.*``: AdamW and its schedule, as for language models) and in
   the gathered rows, and updates only the touched rows (``embedding.optimizer``:
   row-wise Adagrad or SGD at ``embedding.lr``; ``jaxpar.embedding.sparse_update``).

DLRM is a task of the shared loop (``jaxpar.train.loop.train``), which gives it the run
dir, ``config.yaml``, dry run, resume, evaluation cadence, metrics, checkpoints and stop
signals. Its own parts are here: ``DLRMTask`` (loader, tables, step; on resume the
checkpoint's table written back into the host table), ``DLRMTrainer`` (a step through
the cache; a checkpoint's state with the cache flushed) and ``evaluation``.
``metrics.jsonl`` adds ``samples_per_s``, the cache's ``hit_rate`` (unique ids of the
batch found on the device), ``h2d_bytes`` / ``d2h_bytes`` and ``evictions`` per step, and
``val_auc`` at eval steps (the held-out rows read exactly, without disturbing the
cache). A checkpoint holds the exact table and its optimizer state, so a run resumes
exactly on a cache of any size or none; the table is written from the live host table a
block at a time, never copied whole, while the run waits (``save_checkpoint``).

Several processes (JAX's distributed runtime, ``JAXPAR_COORDINATOR`` ...: see
``jaxpar.placement.runtime.initialize_distributed``; gloo on CPUs) train as one process
with all their devices does, the same losses but for the order of the dense
gradients' all-reduce (2 processes x 2 CPU devices against 1 x 4: within 2e-7):

- every process makes the same dense parameters and optimizer state from the seed and
  puts them on the global mesh from host values (``initial_state``);
- each process reads its slice of every batch (the loaders'), and puts its own rows on
  its devices; the batch's ids alone are gathered (``whole_batch``: ``B * F`` ints a
  step), since the caches' maps need the global batch's (``placer``);
- with ``embedding.sharding`` row_wise or table_wise each process holds the host rows,
  caches and prefetch thread of its own devices' shards, and keeps the others' caches'
  maps alone, which every process computes alike (``jaxpar.embedding.ShardedCache``);
  replicated, each holds the whole table and cache, all alike; a split table without a
  cache (``cache_ratio: null``) is gathered whole for evaluation and checkpoints;
- evaluation gathers the held-out batches, every process computing the same
  ``val_loss`` and ``val_auc``;
- a checkpoint's dense state is written by orbax from every process, and a split host
  table by each process for its own shards' rows (``table_leaves``;
  ``jaxpar.train.row_blocks``), a replicated one by process 0 (with an orbax the block
  writer cannot use, the split table is gathered a block at a time and process 0 writes
  it whole: ``RowBlocks.whole``); on restore each process reads the table and keeps
  its shards' rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import pathlib
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.embedding import DeviceTable, EmbeddingCache, ShardedCache, ShardingPlan, SparseOptimizer, cache_rows_for
from jaxpar.embedding.transfer import place
from jaxpar.models.dlrm import DLRM, DLRMConfig, bce_loss
from jaxpar.offload.budget import parse_bytes
from jaxpar.train import data as data_lib
from jaxpar.train.auc import auc
from jaxpar.train.checkpoints import Checkpoints
from jaxpar.train.config import Config, load_config
from jaxpar.train.recsys_data import recsys_loader
from jaxpar.train.row_blocks import RowBlocks
from jaxpar.train.stepping import build_mesh, make_optimizer, save
from jaxpar.train.trainer import Hook, StepInfo, Trainer

log = logging.getLogger(__name__)

# embedding.sharding -> jaxpar.embedding.ShardingPlan's kind (TorchRec's ShardingType names).
SHARDINGS = {"row_wise": "row", "table_wise": "table"}

# Batches of training ids whose counts warm the cache up (Colossal-AI counts a sample of
# the dataset's ids).
WARMUP_BATCHES = 16


def cache_rows(cfg: Config, rows: int) -> int | None:
    """Rows a device's cache holds of the ``rows`` it caches (the table's, or with
    ``embedding.sharding`` its shard's); None: no cache, the table on the devices."""
    m, e = cfg.model, cfg.embedding
    if e.cache_ratio is None:
        return None
    if e.cache_ratio != "auto":
        return cache_rows_for(rows, e.cache_ratio)
    budget = e.device_budget and parse_bytes(e.device_budget, name="embedding.device_budget")
    if not budget:
        budget = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if not budget:
        raise ValueError("embedding.cache_ratio=auto needs embedding.device_budget (this device does not say "
                         "its memory)")
    row_bytes = 4 * (m.embed_dim + (1 if e.optimizer == "adagrad" else 0))
    cached = min(rows, budget // row_bytes)
    log.info("embedding.cache_ratio=auto: %d of %d rows (%.4g) in %s of device memory", cached, rows,
             cached / rows, e.device_budget or f"{budget} bytes")
    return cached


def build_tables(cfg: Config, table: np.ndarray, mesh) -> EmbeddingCache | ShardedCache | DeviceTable:
    """The table's home: a device cache over the host table, or the table on the
    devices; replicated on each, or split row-wise or table-wise over ``mesh.data``
    (with a cache: one per device over its own shard)."""
    e = cfg.embedding
    optimizer = SparseOptimizer(e.optimizer)
    if e.sharding != "replicated":
        plan = ShardingPlan(cfg.model.table_rows, mesh.shape["data"], SHARDINGS[e.sharding])
        rows = cache_rows(cfg, plan.shard_rows)
        if rows is None:
            return DeviceTable(table, optimizer=optimizer, plan=plan, mesh=mesh, axis="data")
        return ShardedCache(table, rows, plan=plan, mesh=mesh, axis="data", optimizer=optimizer,
                            eviction=e.eviction, prefetch=e.prefetch)
    sharding = NamedSharding(mesh, P())
    rows = cache_rows(cfg, cfg.model.total_rows)
    if rows is None:
        return DeviceTable(table, optimizer=optimizer, device=sharding)
    return EmbeddingCache(cfg.model.total_rows, cfg.model.embed_dim, rows, optimizer=optimizer,
                          eviction=e.eviction, prefetch=e.prefetch, table=table, device=sharding)


def make_step(graphdef, stub, tx, lookup, update):
    """The jitted train step ``(params, opt_state, arrays, slots, batch, lr) -> (params,
    opt_state, arrays, out)``; ``stub``: the table's place in the model (zero rows: the
    step's rows come from ``arrays``); ``lookup(arrays, slots)`` and ``update(arrays,
    slots, grads, lr)``: the table's (``EmbeddingCache`` or ``DeviceTable``). Everything
    but ``lr`` and the batch is donated."""

    def loss_fn(params, emb, batch):
        model = nnx.merge(graphdef, stub, params)
        return bce_loss(model(batch["dense"], emb), batch["labels"])

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, arrays, slots, batch, lr):
        emb = lookup(arrays, slots)  # [B, F, D]
        loss, (g_params, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, emb, batch)
        updates, opt_state = tx.update(g_params, opt_state, params)
        params = optax.apply_updates(params, updates)
        arrays = update(arrays, slots, g_emb, lr)
        return params, opt_state, arrays, {"loss": loss, "grad_norm": optax.tree.norm(g_params)}

    return step


@functools.lru_cache(maxsize=4)
def _model_maker(m: DLRMConfig, seed: int):
    """One program makes the model (made op by op, it compiled one per operation and
    shape, some 40), traced and compiled once per process for each shape and seed: the
    same jitted function each time, so every later ``train`` or ``load_run`` of the same
    model (a resumed run, a sweep, a notebook) reuses it."""
    return nnx.jit(lambda: DLRM(m, rngs=nnx.Rngs(seed)))


def initial_state(cfg: Config, sharding):
    """``(graphdef, stub, state, tx, schedule)`` of a fresh run: ``state`` holds
    the dense ``params`` and ``opt_state`` (on ``sharding``), the whole ``table`` and,
    with row-wise Adagrad, its ``table_state`` (numpy: the checkpoint's layout); ``stub``
    stands for the table in the model (the step's rows come from the cache)."""
    m = cfg.model
    # the table is made in host memory, never on a GPU (this process's CPU: every process
    # makes the same values from the same seed)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = _model_maker(m, cfg.seed)()
    graphdef, table_state, params = nnx.split(model, nnx.PathContains("table"), ...)
    stub = jax.tree.map(lambda t: np.zeros((0, m.embed_dim), t.dtype), table_state)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.steps)
    if isinstance(sharding, jax.Device):
        sharding = jax.sharding.SingleDeviceSharding(sharding)
    # from host values: over several processes each puts its own devices' copies
    params = jax.tree.map(lambda x: place(np.asarray(x), sharding), params)
    state = {"params": params, "opt_state": jax.jit(tx.init, out_shardings=sharding)(params),
             "table": np.asarray(table_state["table"][...])}
    optimizer = SparseOptimizer(cfg.embedding.optimizer)
    if optimizer.has_state:
        state["table_state"] = np.full(m.total_rows, optimizer.initial_accumulator, np.float32)
    return graphdef, stub, state, tx, schedule


def load_run(run_dir) -> tuple[Config, int, dict]:
    """``(config, step, state)`` of the newest checkpoint of a ``jaxpar-train dlrm`` run
    (``state`` as ``initial_state`` lays it out, the table exact)."""
    run_dir = pathlib.Path(run_dir)
    cfg = load_config(str(run_dir / "config.yaml"))
    state = initial_state(cfg, jax.devices()[0])[2]
    with Checkpoints(run_dir, keep=cfg.checkpoint.keep) as checkpoints:
        restored = checkpoints.restore_latest(state)
    if restored is None:
        raise FileNotFoundError(f"{run_dir} has no readable checkpoint")
    return cfg, restored[0], restored[1]


class DLRMTask:
    """``task: dlrm`` as the shared loop's task (``jaxpar.train.loop``): ``build`` makes
    the mesh, the loader and its held-out batches, the dense state, the table's home
    (``build_tables``) and the step; ``start`` loads a checkpoint's table into it and
    warms the cache up; its ``DLRMTrainer`` steps through the cache and flushes it into
    each checkpoint; ``close`` stops the cache's prefetch thread."""

    replica_parallel = None  # Checkpoints' default
    tables = None

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # every model field shapes the arrays; the table's optimizer its state's
        self.same_model = ([f.name for f in dataclasses.fields(cfg.model)], (("embedding", "optimizer"),))

    def build(self) -> None:
        cfg, m = self.cfg, self.cfg.model
        self.mesh = mesh = build_mesh(cfg)
        replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        if cfg.batch_size % mesh.shape["data"]:
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of mesh.data={mesh.shape['data']}")
        self.loader, val_batches = recsys_loader(
            cfg.data.format, m.table_rows, cfg.batch_size, seed=cfg.seed, path=cfg.data.path,
            zipf_alpha=cfg.data.zipf_alpha, cache_dir=data_lib.cache_dir_of(cfg.cache_dir),
            eval_steps=cfg.eval.batches, dense_features=m.dense_features)
        # every process's eval rows, the same on each (the loaders give each process its slice)
        self.validation = [jax.tree.map(whole_batch, b) for b in val_batches[: cfg.eval.batches]
                           ] if cfg.eval.every else []
        self.graphdef, self.stub, state, tx, self.schedule = initial_state(cfg, replicated)
        table = state["table"]
        self.tables = build_tables(cfg, table, mesh)
        # The table lives in `tables` now; a checkpoint's restore needs only its shape (np.empty
        # touches no memory until orbax fills it).
        state["table"] = np.empty_like(table)
        del table
        self.state = state
        self.step_fn = make_step(self.graphdef, self.stub, tx, self.tables.lookup, self.tables.update)
        self.rows_of = functools.partial(np.add, m.offsets)  # per-feature ids [B, F] -> rows of the concatenated table
        self.placed = placer(self.tables, by_batch, self.rows_of)
        if not cfg.dry_run:  # one line before anything is written
            self.tables.check_fits(self.rows_of(whole_batch(self.loader.batch(0)["sparse"])))

    def dry_run(self) -> dict:
        from jaxpar.profiler import profile

        slots, batch = self.placed(self.loader.batch(0))
        return profile(self.step_fn.lower(self.state["params"], self.state["opt_state"], self.tables.arrays, slots,
                                          batch, self.cfg.embedding.lr).compile())

    def restore_target(self) -> dict:
        return self.state

    def start(self, restored, base_batch: int) -> DLRMTrainer:
        """The trainer: the state fresh, or ``restored``'s (its table written back into
        the cache's host table, the loader moved to its step); the cache warmed up with
        the next batches' ids (Colossal-AI's sample); evaluation at ``eval.every``."""
        cfg, tables, loader = self.cfg, self.tables, self.loader
        state = self.state
        if restored is not None:
            state, meta = restored[1], restored[2]
            tables.load(np.asarray(state["table"]), state.get("table_state"))
            loader.restore(meta["loader"])
        cached = not isinstance(tables, DeviceTable)
        if cached and cfg.embedding.warmup_ratio:
            sample = whole_batch(np.stack([self.rows_of(loader.batch(loader.step + k)["sparse"])
                                           for k in range(WARMUP_BATCHES)]), axis=1)
            tables.warmup(sample, ratio=cfg.embedding.warmup_ratio)
        trainer = DLRMTrainer(self, state["params"], state["opt_state"], ahead=cfg.embedding.prefetch if cached else 0)
        if self.validation:
            forward = jax.jit(lambda params, dense, emb: nnx.merge(self.graphdef, self.stub, params)(dense, emb))
            trainer.add_hook(evaluation(forward, tables, self.validation, self.rows_of), every=cfg.eval.every)
        return trainer

    def save_files(self, run_dir: pathlib.Path) -> None:
        pass  # config.yaml alone

    def close(self) -> None:
        if self.tables is not None:
            self.tables.close()


class DLRMTrainer(Trainer):
    """The shared ``Trainer``'s hooks over a DLRM's step: each step makes its batch's
    rows resident in the cache (the next ``ahead`` batches' prefetched meanwhile), and a
    checkpoint's state is the dense state and the flushed table (``table_leaves``)."""

    def __init__(self, task: DLRMTask, params, opt_state, *, ahead: int):
        self.task, self.params, self.opt_state, self.ahead = task, params, opt_state, ahead
        self.loader, self.tables, self.steps = task.loader, task.tables, task.cfg.steps
        self.hooks = []

    def run(self, step: int) -> tuple[dict, dict]:
        task, loader, tables = self.task, self.loader, self.tables
        upcoming = [loader.batch(loader.step + k)["sparse"] for k in range(1, self.ahead + 1)]
        began = time.perf_counter()
        slots, batch = task.placed(next(loader), upcoming)
        self.params, self.opt_state, tables.arrays, out = task.step_fn(self.params, self.opt_state, tables.arrays,
                                                                       slots, batch, task.cfg.embedding.lr)
        loss = float(out["loss"])  # waits for the step
        elapsed, stats = time.perf_counter() - began, tables.last_step  # the cache's hits, transfers, evictions
        record = {"step": step, "loss": loss, "lr": float(task.schedule(step - 1)),
                  "grad_norm": float(out["grad_norm"]), "samples_per_s": task.cfg.batch_size / elapsed,
                  "step_time_s": elapsed, "hit_rate": stats.hit_rate, "h2d_bytes": stats.h2d_bytes,
                  "d2h_bytes": stats.d2h_bytes, "evictions": stats.evictions}
        return record, {"loss": f"{loss:.4f}", "samples/s": f"{record['samples_per_s']:.0f}",
                        "hits": f"{stats.hit_rate:.1%}"}

    def checkpoint_state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state, **table_leaves(self.tables)}

    def context(self):
        return contextlib.nullcontext()


def whole_batch(local: np.ndarray, axis: int = 0) -> np.ndarray:
    """The global batch of a process-local ``local`` (this process's rows along ``axis``,
    as the loaders slice a batch: equal slices, process 0's first): every process's
    slice gathered, the same on each (a collective: every process calls it); ``local``
    itself in one process."""
    if jax.process_count() == 1:
        return local
    return np.concatenate(list(multihost_utils.process_allgather(np.asarray(local))), axis=axis)


def placer(tables, sharding, rows_of):
    """``placed(batch, upcoming=()) -> (slots, batch)``: a process-local batch's rows
    made resident in ``tables`` and its slots, dense features and labels on the devices
    (split by ``sharding``); ``upcoming``: the next batches' local per-feature ids.

    Over several processes the caches' maps need the global batch's ids (every process
    plans every shard's cache: ``ShardedCache``), so the ids, not the dense features,
    are gathered (one collective a step, ``B * F`` ints a batch); each process then puts
    its own rows, which the global sharding gives to its devices."""
    def put(local):
        if sharding.is_fully_addressable:
            return jax.device_put(local, sharding)
        return jax.make_array_from_process_local_data(sharding, local)

    def placed(batch, upcoming=()):
        ids = rows_of(whole_batch(np.stack([batch["sparse"], *upcoming]), axis=1))  # [1 + ahead, B, F]
        slots = tables.prepare(ids[0], list(ids[1:]))
        b = len(batch["labels"])
        here = slice(jax.process_index() * b, (jax.process_index() + 1) * b)  # this process's rows of the batch
        return put(slots[here]), {"dense": put(batch["dense"]), "labels": put(batch["labels"])}

    return placed


def table_leaves(tables) -> dict:
    """A checkpoint's ``table`` and (row-wise Adagrad) ``table_state``: ``RowBlocks``
    read from the live host table, flushed first (a cache's table: views of it; a split
    one's: each block's rows gathered from the shards), never a whole copy. A table on
    the devices is read to the host once (there is no host table to copy)."""
    if isinstance(tables, ShardedCache):
        rows, states = tables.shard_views()
        owned, align = tables.owned_ranges() or (None, 0)  # over several processes: this one's rows

        def of(shards):
            here = next(shard for shard in shards if shard is not None)  # None: another process's
            return RowBlocks((tables.num_rows, *here.shape[1:]), here.dtype,
                             functools.partial(tables.plan.rows_from_shards, shards), owned, align)
        leaves = {"table": of(rows)}
        if states is not None:
            leaves["table_state"] = of(states)
        return leaves
    leaves = {"table": RowBlocks.of(tables.table())}
    if tables.optimizer.has_state:
        leaves["table_state"] = RowBlocks.of(tables.optimizer_state())
    return leaves


def save_checkpoint(checkpoints: Checkpoints, step: int, params, opt_state, tables, loader, cfg: Config) -> None:
    """The dense state, the exact table and its optimizer state (a ``DLRMTrainer``'s
    ``checkpoint_state``, which the loop saves), the data position and the config;
    returns once written.

    The table is not copied: a host table can be most of the host's memory, and copies
    (ours of the live table, then orbax's of that numpy leaf) held three. It is written
    from the live table a block of rows at a time (``table_leaves``: two blocks at once,
    each at most 64 MiB and a sixteenth of it; ``jaxpar.train.row_blocks``), and since
    later steps change it in place, the step waits until the save is written (the dense
    state with it: its write overlaps the table's; on the dlrm preset's 12 MiB table a
    save holds the run 0.12 s, 0.08 s more than the copies did)."""
    save(checkpoints, step, {"params": params, "opt_state": opt_state, **table_leaves(tables)}, loader, cfg)


_bce_loss = jax.jit(bce_loss)  # one program (op by op: one per operation)


def evaluation(forward, tables, batches, rows_of) -> Hook:
    """A ``Trainer`` hook adding ``val_loss`` and ``val_auc`` over the held-out
    ``batches``, their rows read exactly (in one read: a cache flushes once, a split
    table is gathered once), and the AUC to the progress bar; skipped after a non-finite
    training loss, which stops the run anyway."""

    def hook(info: StepInfo) -> None:
        if not math.isfinite(info.record["loss"]):
            return
        embs = tables.rows_of(np.stack([rows_of(batch["sparse"]) for batch in batches]))  # [n, B, F, D]
        logits = np.concatenate([np.asarray(forward(info.params, batch["dense"], emb))
                                 for batch, emb in zip(batches, embs)])
        labels = np.concatenate([batch["labels"] for batch in batches])
        info.record["val_loss"] = float(_bce_loss(logits, labels))
        try:
            info.record["val_auc"] = auc(logits, labels)
        except ValueError:  # one class only among the held-out labels: AUC undefined
            return
        info.postfix["auc"] = f"{info.record['val_auc']:.4f}"

    return hook
