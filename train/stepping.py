"""The loop every task's training shares: step, record, checkpoint, stop.

``run_steps`` runs steps ``start + 1 ..`` of any task (a language model, a GliDe
draft, a DLRM) until ``finished`` (step ``cfg.steps``; with AdaScale, the progress
``cfg.steps``): each ``one_step(step)`` returns the step's metrics record and the
progress bar's figures; ``Recorder`` appends the record to ``metrics.jsonl`` and
TensorBoard (process 0) and moves the bar; a checkpoint is saved every
``checkpoint.every`` steps and at the last; SIGINT / SIGTERM stop the run at the next
step boundary with that step saved (``jaxpar.train.stopping``); a non-finite loss stops
it with the last good checkpoint named.

What every task builds alike is here too: the mesh (``build_mesh``), the dense
parameters' optimizer (``make_optimizer``) and a checkpoint's write (``save``).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import pathlib
from collections.abc import Callable

# tqdm.auto draws a widget in a Jupyter kernel, but without ipywidgets it warns "IProgress
# not found" (on import) and falls back to the text bar: take the text bar directly then.
if importlib.util.find_spec("ipywidgets") is None:
    from tqdm.std import tqdm
else:
    from tqdm.auto import tqdm

import jax
import optax

import jaxpar
from jaxpar.elastic import adascale as adascale_lib
from jaxpar.train import tensorboard
from jaxpar.train.checkpoints import CheckpointError, Checkpoints
from jaxpar.train.config import Config, ConfigError, OptimizerConfig, to_dict
from jaxpar.train.stopping import Stopped, stop_on_signals


class TrainingError(RuntimeError):
    """A run that cannot start or go on; the CLI prints it on one line and exits 1."""


def finished(record: dict, steps: int) -> bool:
    """Whether a run of ``steps`` ends at ``record``'s step: at step ``steps``, or, where
    the record counts AdaScale's progress (``optimizer.batch_scaling=adascale``: the sum
    of its gains, in steps at the base batch, as AdaScale and AdaptDL define a run's
    length), when that progress reaches ``steps``."""
    return record.get("adascale_progress", record["step"]) >= steps


def rewrite_metrics(path: pathlib.Path, upto: int) -> None:
    """Drops metrics of steps after ``upto`` (a resumed run logs them again)."""
    if path.exists():
        lines = [l for l in path.read_text().splitlines() if l and json.loads(l)["step"] <= upto]
        path.write_text("".join(l + "\n" for l in lines))


class Recorder:
    """``metrics.jsonl`` and TensorBoard events in ``run_dir`` (written by the lead
    process only; a resumed run first drops what it logged after ``start``), and the
    progress bar."""

    def __init__(self, run_dir: pathlib.Path, start: int, steps: int, *, lead: bool, progress: bool,
                 done: float | None = None):
        """``done``: where the bar starts (default ``start``; AdaScale's progress for a
        run that counts it, which then moves the bar by each step's gain)."""
        self.lead = lead
        metrics = run_dir / "metrics.jsonl"
        if lead:
            rewrite_metrics(metrics, start)
            tensorboard.truncate(run_dir / "tensorboard", start)
        self.board = tensorboard.writer(run_dir / "tensorboard") if lead else None
        self.file = metrics.open("a") if lead else None
        self.bar = tqdm(total=steps, initial=start if done is None else done, disable=not progress or not lead,
                        dynamic_ncols=True, desc="train")

    def write(self, record: dict, postfix: dict) -> None:
        if self.lead:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            for name, value in record.items():
                if name != "step" and self.board is not None and isinstance(value, (int, float)):  # not lists
                    self.board.add_scalar(name, value, record["step"])
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(record.get("adascale_gain", 1))

    def close(self) -> None:
        self.bar.close()
        if self.board is not None:
            self.board.close()
        if self.file is not None:
            self.file.close()


def run_steps(start: int, steps: int, every: int, *, one_step: Callable[[int], tuple[dict, dict]],
              save: Callable[[int], None], recorder: Recorder, where: str) -> list[dict]:
    """Steps ``start + 1 ..`` until one is ``finished`` (step ``steps``, or AdaScale's
    progress ``steps``); returns their records. ``one_step(step)`` runs one and returns
    ``(record, postfix)`` (``record["loss"]`` the step's loss); ``save(step)``
    checkpoints (every ``every`` steps, 0 never, and at the last); ``where``: the
    checkpoints' directory, for messages."""
    history, last_saved = [], start
    try:
        with stop_on_signals() as stop:
            for step in itertools.count(start + 1):
                record, postfix = one_step(step)
                last = finished(record, steps)
                loss = record["loss"]
                if not math.isfinite(loss):
                    raise TrainingError(f"loss is {loss} at step {step}; stopped. The last good checkpoint "
                                        f"(step {last_saved}) in {where} is intact")
                history.append(record)
                recorder.write(record, postfix)
                if (every and step % every == 0) or last:
                    save(step)
                    last_saved = step
                if last:
                    break
                signum = stop.agreed()
                if signum is not None:  # every process stops here, this step saved
                    if last_saved != step:
                        save(step)
                        last_saved = step
                    raise Stopped(signum, step, last_saved)
    finally:
        recorder.close()
    return history


def build_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """The mesh of ``cfg.layout`` (``cfg.mesh.axis_types``); ``data`` None takes the
    devices the other axes leave. Sizes that ask for fewer devices than one process has
    take its first ones (a job given part of a host, as an elastic job resized to fewer
    devices is)."""
    devices = jax.devices() if devices is None else devices
    layout = cfg.layout
    others = layout.fsdp * layout.expert * layout.pipe * layout.seq * layout.tensor_ways
    data = layout.data
    if data is not None and jax.process_count() == 1 and data * others < len(devices):
        devices = devices[:data * others]
    if data is None:
        if others < 1 or len(devices) % others:
            raise ConfigError(
                f"mesh fsdp={layout.fsdp} expert={layout.expert} pipe={layout.pipe} seq={layout.seq} "
                f"tensor={layout.tensor} ({others} devices) does not divide {len(devices)} devices"
            )
        data = len(devices) // others
    try:
        return jaxpar.make_mesh(data=data, fsdp=layout.fsdp, expert=layout.expert, pipe=layout.pipe,
                                seq=layout.seq, tensor=layout.tensor, devices=devices,
                                axis_types=cfg.mesh.axis_types)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_optimizer(opt: OptimizerConfig, steps: int, scale: float = 1.0, *,
                   adascale: tuple[int, int, int] | None = None):
    """``(tx, schedule)``: clipped AdamW with warmup and cosine decay, its peak ``opt.lr``
    times ``scale`` (``batch_scale``'s), on the step clock whatever the batch; the
    ``schedule`` returned (what the step records log) is compiled as one program
    (called outside a step, optax's schedule runs op by op, a dozen programs compiled in
    every process).
    ``adascale``: ``(base, batch, replicas)``: AdamW's learning rate scaled by AdaScale's
    gain instead (``jaxpar.elastic.adascale``: the schedule read at the gain's progress;
    the step passes the noise scale's norms to ``tx.update``)."""
    warmup = min(opt.warmup_steps, steps)
    peak = opt.lr * scale
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, peak, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
        end_value=peak * opt.min_lr_ratio,
    )
    if adascale is None:
        adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay)
    else:  # optax.adamw with its last part, the learning rate, AdaScale's
        base, batch, replicas = adascale
        adamw = optax.chain(optax.scale_by_adam(b1=opt.b1, b2=opt.b2), optax.add_decayed_weights(opt.weight_decay),
                            adascale_lib.scale_by_adascale(schedule, base=base, batch=batch, replicas=replicas))
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), adamw), jax.jit(schedule)


def save(checkpoints: Checkpoints, step: int, state: dict, loader, cfg: Config, **meta) -> None:
    """Checkpoints ``state`` at ``step`` with the ``loader``'s position, the config and
    ``meta``; a save that does not happen is a ``TrainingError``."""
    try:
        checkpoints.save(step, state, {"step": step, "loader": loader.state(), **meta, "config": to_dict(cfg)})
    except CheckpointError as e:
        raise TrainingError(str(e)) from None
