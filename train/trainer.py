"""One training step and the hooks after it (Levanter's trainer is the model).

``Trainer.step(step)`` takes the next batch from its ``Batches``, runs the compiled
train step, times it and makes the step's metrics record (``step``, ``loss``, ``lr``,
``grad_norm``, ``tokens_per_s``, ``step_time_s``, ``device_live_bytes``); then every
hook due at that step (``add_hook(hook, every=N)``: at multiples of ``N`` and at the
last step) sees a ``StepInfo`` and may add to the record and the progress bar's
figures: evaluation (``val_loss``), the MFU estimate, and whatever a feature plugs in
(rebalancing batch weights, say) without a branch in the loop.

What the step computes (its reduction, its pipeline, its offload) is the compiled
program's business, an argument of ``make_train_step``; what it reads is ``Batches``'.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpar.train import offload as offload_lib
from jaxpar.train.loader import Loader
from jaxpar.train.stepping import finished


@dataclasses.dataclass
class Batches:
    """The run's data: ``loader`` (the training stream, checkpointed), ``batch_of(split,
    rows, local)`` (this process's loader rows of ``split`` as the step's global batch),
    and ``validation`` (the fixed evaluation batches: ``(rows, local)`` pairs)."""

    loader: Loader
    batch_of: Callable
    validation: list
    row_split: Any = None  # with data.batch_weights: the jaxpar.train.weighted.RowSplit in force

    def next_train(self):
        rows = self.loader.local_rows(self.loader.step)
        local = next(self.loader)
        if self.row_split is not None:  # each device's rows padded to the slot
            local = self.row_split.padded(local, self.loader.process)
        return self.batch_of("train", rows, local)

    def share(self, row_split) -> None:
        """From the next batch on, the rows of each process are ``row_split``'s."""
        self.row_split = row_split
        self.loader.share(row_split.rows)


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after step ``step``: the state after it, its metrics ``record``
    and the progress bar's ``postfix`` (both for the hook to add to), and whether it is
    the run's ``last`` step."""

    step: int
    params: Any
    opt_state: Any
    record: dict
    postfix: dict
    last: bool


Hook = Callable[[StepInfo], None]


class Trainer:
    """The state between steps (``params``, ``opt_state``) and what runs each step: the
    step itself (``run``, a transformer's compiled step on ``Batches``' next batch), then
    the hooks due. Another task's trainer (``jaxpar.train.recsys.DLRMTrainer``) keeps
    ``step``'s hooks and gives its own ``run``, ``checkpoint_state`` and ``context``."""

    def __init__(self, step_fn, params, opt_state, batches: Batches, *, lr: Callable[[int], float],
                 tokens_per_step: int, steps: int, frozen: tuple = ()):
        self.step_fn, self.params, self.opt_state, self.batches = step_fn, params, opt_state, batches
        self.lr, self.tokens_per_step, self.steps, self.frozen = lr, tokens_per_step, steps, frozen
        self.loader = batches.loader  # whose position a checkpoint holds
        self.hooks: list[tuple[Hook, int]] = []

    def add_hook(self, hook: Hook, every: int = 1) -> None:
        """Runs ``hook`` after every ``every``-th step and after the last."""
        self.hooks.append((hook, every))

    def step(self, step: int) -> tuple[dict, dict]:
        """Runs step ``step`` and the hooks due; returns its record and the progress
        bar's figures."""
        record, postfix = self.run(step)
        info = StepInfo(step, self.params, self.opt_state, record, postfix, last=finished(record, self.steps))
        for hook, every in self.hooks:
            if step % every == 0 or info.last:
                hook(info)
        return record, postfix

    def run(self, step: int) -> tuple[dict, dict]:
        """The step alone: its record and the progress bar's figures."""
        batch = self.batches.next_train()
        began = time.perf_counter()
        self.params, self.opt_state, out = self.step_fn(self.params, self.opt_state, batch, *self.frozen)
        loss = float(out["loss"])
        elapsed = time.perf_counter() - began
        record = {"step": step, "loss": loss, "lr": float(self.lr(step - 1)), "grad_norm": float(out["grad_norm"]),
                  "tokens_per_s": self.tokens_per_step / elapsed, "step_time_s": elapsed,
                  "device_live_bytes": offload_lib.device_live_bytes()}
        record.update({k: float(v) for k, v in out.items() if k not in ("loss", "grad_norm")})  # a step option's
        postfix = {"loss": f"{loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}", "step": f"{elapsed * 1e3:.0f}ms"}
        return record, postfix

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds: the state in model order (the step may store it
        otherwise)."""
        return self.step_fn.in_model_order({"params": self.params, "opt_state": self.opt_state})

    def context(self):
        """The context the steps run in: the step's mesh, rules and execution."""
        return self.step_fn.context()


def evaluation(step_fn, batches: Batches, frozen: tuple, programs: dict | None = None) -> Hook:
    """Adds ``val_loss``: the mean loss over the fixed validation batches (skipped after
    a non-finite training loss, which stops the run anyway). ``programs``: where the
    jitted loss is kept for ``step_fn`` (``jaxpar.train.loop``'s store, which holds the
    step: a later run of the same config evaluates without tracing the loss again)."""
    import jax

    programs = {} if programs is None else programs
    key = ("evaluation", id(step_fn))  # the store keeps step_fn alive: its id stays its own
    if key not in programs:
        programs[key] = jax.jit(lambda params, batch, *frozen: step_fn.loss(step_fn.model(params), batch, *frozen))
    loss = programs[key]

    def hook(info: StepInfo) -> None:
        if not math.isfinite(info.record["loss"]):
            return
        losses = [loss(info.params, batches.batch_of("validation", rows, b), *frozen)
                  for rows, b in batches.validation]
        info.record["val_loss"] = float(np.mean([float(l) for l in losses]))
        info.postfix["val"] = f"{info.record['val_loss']:.3f}"

    return hook


def utilisation(flops_per_token: float, peak: float) -> Hook:
    """Adds the model FLOPs utilisation to the progress bar: ``flops_per_token`` times
    the step's tokens/s over ``peak`` (the devices' FLOP/s together)."""

    def hook(info: StepInfo) -> None:
        info.postfix["MFU"] = f"{flops_per_token * info.record['tokens_per_s'] / peak:.1%}"

    return hook
