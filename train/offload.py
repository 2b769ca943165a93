"""jaxpar-train's side of ``jaxpar.offload``: the plan a config's ``offload`` section
asks for, the fields it adds to ``dry_run``'s JSON, and the device bytes a step leaves
live (``metrics.jsonl``'s ``device_live_bytes``)."""

from __future__ import annotations

import collections
import math

import jax

from jaxpar.layout import Layout
from jaxpar.models.config import CHECKPOINT_NAMES
from jaxpar.models.transformer import ACT_BTD, ACT_BTF, ACT_BTKH, ACT_BTNH
from jaxpar.offload import budget as budget_lib
from jaxpar.offload.planner import H100_PEAK_FLOPS, Plan, PlanError, decided, plan
from jaxpar.placement import rules as rules_lib
from jaxpar.train.config import Config, ConfigError


def activation_bytes(cfg: Config, mesh, rules) -> dict[str, int]:
    """Per-device bytes of each ``checkpoint_name``'s residuals over all layers of one
    step: one microbatch (``batch_size / grad_accum`` rows) of the compute dtype, each
    dimension divided by the mesh axes the rules split it over (rounded up).

    layer_input [B, T, D], query [B, T, N, H], key and value [B, T, K, H], attention
    [B, T, N, H], mlp_hidden [B, T, F] (``CHECKPOINT_NAMES``), times ``model.layers``.
    """
    m = cfg.model
    B, T = cfg.batch_size // cfg.layout.grad_accum, cfg.seq_len
    shapes = {
        "layer_input": ((B, T, m.dim), ACT_BTD),
        "query": ((B, T, m.heads, m.head_dim), ACT_BTNH),
        "key": ((B, T, m.kv_heads, m.head_dim), ACT_BTKH),
        "value": ((B, T, m.kv_heads, m.head_dim), ACT_BTKH),
        "attention": ((B, T, m.heads, m.head_dim), ACT_BTNH),
        "mlp_hidden": ((B, T, m.mlp_dim), ACT_BTF),
    }
    assert set(shapes) == set(CHECKPOINT_NAMES), "a checkpoint name without a shape here"
    itemsize = m.compute_dtype.itemsize
    sizes = {}
    for name, (shape, axes) in shapes.items():
        spec = rules_lib.logical_to_spec(axes, rules) if mesh is not None else (None,) * len(shape)
        ways = [math.prod(mesh.shape[a] for a in rules_lib.as_tuple(s)) if mesh is not None else 1
                for s in spec]
        sizes[name] = m.layers * itemsize * math.prod(-(-n // w) for n, w in zip(shape, ways))
    return sizes


def saved_names(layout: Layout) -> tuple[str, ...]:
    """The checkpoint names whose residuals the step keeps on the device without
    offload: all with ``remat=none`` (the backward reads each of them), ``remat_names``
    with ``remat=names``; none known by name under ``full`` or the ``dots`` policies
    (they save other values, the projections' outputs before RoPE and the gating)."""
    if layout.remat == "none":
        return CHECKPOINT_NAMES
    if layout.remat == "names":
        return tuple(layout.remat_names)
    return ()


def _budget(cfg: Config) -> tuple[int | None, str | None]:
    """The plan's budget: ``offload.device_budget``, else the device's own memory where
    the backend says (None: no limit), and how a nothing-fits message names it."""
    offload = cfg.offload
    if offload.budget is not None:
        return offload.budget, f"offload.device_budget={offload.device_budget}"
    budget = budget_lib.device_memory(jax.devices()[0])
    return budget, None if budget is None else f"the device's memory ({budget_lib.format_bytes(budget)})"


def needs_profile(cfg: Config, abstract_state: dict) -> bool:
    """Whether ``resolve`` needs the all-on-device step's profile: with a budget to check
    (``_budget``) or more than one plan to weigh. A fixed placement without a budget
    (``jaxpar.offload.planner.decided``) does not: a run skips that compile."""
    return not decided(abstract_state, _budget(cfg)[0], params=cfg.layout.offload_params,
                       optimizer=cfg.layout.offload_optimizer, resident_layers=cfg.offload.resident_layers)


def resolve(cfg: Config, profile: dict | None, abstract_state: dict, mesh, rules,
            peak_flops: float | None) -> Plan:
    """The plan for ``cfg.offload`` from the all-on-device step's ``profile`` and
    ``abstract_state`` (``TrainStep.abstract_state``). The budget is
    ``offload.device_budget``, else the device's own memory where the backend says.
    ``profile`` may be None where ``needs_profile`` is False: the plan's options are
    the same, its figures leave the profile's out (``jaxpar.offload.planner.plan``).

    Raises:
      ConfigError: no plan fits (one line: the smallest budget that works and what
        dominates it), or the section asks what the plan cannot do.
    """
    offload = cfg.offload
    budget, source = _budget(cfg)
    microbatches = cfg.layout.grad_accum
    if mesh is not None and mesh.shape.get("pipe", 1) > 1:  # a stage fetches its layers for each microbatch
        microbatches = cfg.layout.pipeline_microbatches
    try:
        return plan(abstract_state, mesh, profile, budget, params=cfg.layout.offload_params,
                    optimizer=cfg.layout.offload_optimizer, activations=offload.activations,
                    resident_layers=offload.resident_layers, prefetch=offload.prefetch,
                    grad_accum=microbatches,
                    host_bandwidth=offload.bandwidth, peak_flops=peak_flops or H100_PEAK_FLOPS,
                    activation_bytes=activation_bytes(cfg, mesh, rules),
                    saved_names=saved_names(cfg.layout), budget_source=source)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def dry_run_fields(offload_plan: Plan) -> dict:
    """What ``dry_run`` adds with an ``offload`` section: state bytes by place, bytes
    moved per step each way, and the plan itself."""
    return {
        "device_state_bytes": offload_plan.device_state_bytes,
        "host_state_bytes": offload_plan.host_state_bytes,
        "transfer_bytes": {"host_to_device": offload_plan.host_to_device,
                           "device_to_host": offload_plan.device_to_host},
        "offload_plan": offload_plan.to_dict(),
    }


def device_live_bytes() -> int:
    """Bytes of the live arrays in device memory (memory kind ``device``, or unset) on
    this process's most loaded device. Between steps of a run alone in its process it
    stays within the plan's ``between_steps_bytes`` (the device-resident state, the
    batch and the step's outputs); the step's peak (``Plan.device_bytes``) is not visible
    between steps."""
    return max(live_bytes_per_device().values(), default=0)


def live_bytes_per_device() -> collections.Counter:
    """Bytes of the live arrays in device memory, per device of this process. (From the
    shardings' shard shapes: reading ``shard.data`` would make new live arrays.)"""
    per_device = collections.Counter()
    for array in jax.live_arrays():
        if array.is_deleted() or array.sharding.memory_kind not in (None, "device"):
            continue
        shard_bytes = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
        for device in array.sharding.addressable_devices:
            per_device[device] += shard_bytes
    return per_device
