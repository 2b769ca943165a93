"""The offload plan, as data: which train state lives where under a device budget, what
moves between host and device each step, and how long the step is predicted to take.

``plan(abstract_state, mesh, profile, budget, ...)`` is Elixir's search on jaxpar's
compile-only profile: it enumerates the resident-layer counts (Gemini's static
placement ratio, as a count of stacked layers) x the optimizer's placement, with the
activation offload given, predicts each candidate's device bytes and step time, and
returns the fastest that fits the budget (ties: the one moving fewer bytes, so more
stays on the device). All figures are per device: every device offloads its own shards,
so each leaf counts the bytes of its shard (``sharding.shard_shape``). The accounting
follows what the step does (``jaxpar.offload.fetch`` and ``jaxpar.offload.state``);
``tests/test_offload_plan.py`` checks it against the step's own placement and moves.

Inputs:

* ``abstract_state``: ``{"params": ..., "opt_state": ...}`` of ``ShapeDtypeStruct``s with
  the step's shardings (``TrainStep.abstract_state``). A leaf with a ``layers`` key in
  its path is a stacked layer array ``[L, ...]``: its shard divides into ``L`` equal
  chunks, one per layer (the scan's unit, the fetch's unit). The other parameters
  (``E``: embedding, positions, final norm, head) form two chunks of their own, as
  ``jaxpar.models.Transformer`` reads them (``accounting.NON_LAYER_USES``): the input chunk
  ``C_in`` (embedding, positions: the lookup at the forward's start) and the output
  chunk ``C_out`` (final norm and head, the embedding again when tied: the forward's
  end, fetched again in the backward, whose gradient needs their values; the lookup's
  does not). A parameter of another name counts in both chunks, fetched twice for each.
* ``profile``: ``jaxpar.profiler.profile`` of the ALL-ON-DEVICE step (what
  ``dry_run`` compiles without offload). Its ``temp_bytes`` hold the whole gradient
  (global-norm clipping needs every gradient before any update, and the backward scan
  returns them stacked) and the saved activations; ``flops`` give the compute time.
* ``grad_accum``: ``k`` microbatches per step (each one's forward and backward moves
  what one step without accumulation moves).

What the step does, per step, with ``H = L - R`` host layers of ``p`` bytes each
(gradients: the same), ``f = min(prefetch, H)``:

* ``params=host``: ``E`` and the ``H`` host layers live in ``pinned_host`` memory, the
  ``R`` resident layers on the device. The forward fetches ``C_in``, runs the resident
  layers, streams the host layers (a scan carrying ``f`` fetched layers: step ``i``
  fetches layer ``i + f``, the last ``f`` steps fetch the last layer again, a wasted
  copy, so ``H + f`` fetches per pass) saving only each host layer's input, then
  fetches ``C_out``. The backward fetches ``C_out`` again, streams the host layers in
  reverse (``H + f`` fetches again), recomputing each host layer's forward from its
  saved input (one more forward per host layer) and sending its gradient to the host
  at once, then the resident layers; each non-layer parameter's gradient goes to the
  host where it is made. With ``k > 1`` each microbatch's host gradients are summed on
  the host (``jaxpar.offload.state.accumulate``: the accumulator of a host layer lives
  there), the device-resident ones on the device.
* ``optimizer=device``: ``state.update`` moves every host parameter and gradient to
  the device (``P_h + G_h``), updates there and sends the new host parameters back.
* ``optimizer=host``: every gradient still on the device (``G_d``: the device-resident
  parameters') and every device parameter (``P_d``) go to the host, the update runs
  there (``compute_on``), the new device parameters come back; the moments never move.

Device bytes promised (``Plan.device``, each per device; summed, though the update's
moves and the layers' fetches are not live at once: conservative)::

    params          device-resident params: R p (+ E with params=device)     (exact)
    optimizer       all optimizer state with optimizer=device, else 0        (exact)
    fetched         params=host: the layer window and the larger of the two
                    other chunks, f p + max(p [H > 0], C_in, C_out)           (exact)
    gradients       params=device: G. params=host: R p + the two largest host
                    chunks' gradients (the one made, the one draining); k > 1:
                    + R p (the resident layers' accumulator beside a microbatch's)
    update          params=host, optimizer=device: P_h + G_h, host state brought
                    in                                                       (exact)
    temporaries     profile temp_bytes - whole gradient - saved activations: the
                    step's working buffers, taken from the all-on-device compile;
                    with params=host and k > 1, less two whole gradients: that
                    step holds the accumulator and a microbatch's gradient at once
                    (the sum reads both; ``tests/test_offload_plan.py`` checks its
                    compile holds them), the offloaded step the ``gradients`` above
    activations     saved residuals kept on the device + (prefetch + 1) layers' worth
                    of the offloaded ones in flight; an offloaded ``layer_input``
                    frees only the resident layers' share (a host layer's input is
                    the streamed scan's own residual, on the device)
    inputs_outputs  the batch (profile argument_bytes - state) + outputs that do
                    not reuse a donated buffer

With nothing offloaded this sums to the profile's ``peak_bytes``
(``argument + output - alias + temp``) unless the activation estimate exceeds the
temporaries, in which case the temporaries count as 0 and the sum is larger. With
``optimizer=device`` the update holds every parameter and gradient on the device, so
``params=host`` then never promises less than all on the device: the search pairs it
with ``optimizer=host`` under a budget the all-on-device step exceeds.

``Plan.device_state_bytes`` (``params + optimizer``) is what lives on the device
between steps; with the batch and the step's small outputs (``inputs_outputs``) it is
the most that live device arrays can hold between steps (``Plan.between_steps_bytes``,
what ``jaxpar-train``'s ``device_live_bytes`` is checked against).

Transfer bytes per step (per device; ``F_E`` the non-layer fetches: ``C_in`` once,
``C_out`` twice; ``S_E`` their gradients, one per use; ``A`` offloaded activations
per microbatch)::

    host -> device   k (2 (H + f) p + F_E + A)
                     + optimizer=device: P_h + G_h
                     + optimizer=host: P_d
    device -> host   k (H p + S_E + A)
                     + optimizer=device: P_h
                     + optimizer=host: G_d + P_d

Step time (the prediction that ranks plans; seconds)::

    c = profile flops / peak_flops / L                  compute per layer
    resident layer: max(c / 3, k a / bw) + max(2 c / 3, k a / bw)
    host layer:     max(c / 3, k p / bw, k a / bw) + max(c, k (p + a) / bw)
                    (c: the backward's 2 c / 3 and the recomputed forward)
    + k (2 f p + F_E) / bw, k S_E / bw                 the window fills and the other
                                                       chunks, not overlapped (max of both ways)
    + max(update h2d, update d2h) / bw                 the update's moves, not overlapped
    + optimizer=host: (3 params + 2 optimizer bytes) / host_update_bandwidth
    + params=host, k > 1: 3 k G_h / host_update_bandwidth   the host gradients' sums

``a`` is one layer's share of ``A``, ``bw`` is ``host_bandwidth`` per direction (PCIe is
full duplex); the backward is taken as twice the forward's compute. ``compute_s``
includes the host layers' recomputed forwards, ``H c / 3``.

Conservative where the inputs are estimates (a plan that promises too little OOMs,
ColossalAI#2246): the working temporaries are the all-on-device compile's, which holds
more than an offloaded step needs (a host layer saves only its input); phases not live
at once are summed; the gradients in flight count one chunk more than the minimum;
offloaded activations free device bytes only for ``saved_names`` (names the profiled
step is known to keep: by default none, and then offloading activations frees nothing
in the plan but still costs its transfers); ``host_bandwidth`` and
``host_update_bandwidth`` default below what the hardware reaches (host-side updates
have measured 2-3x slower than expected, axlearn PR#867). The FLOP-based compute time
assumes the peak rate: it under-predicts compute, so the plan sees transfers as more
exposed than they are and keeps more on the device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import jax

from jaxpar.inputs import InputError
from jaxpar.offload.accounting import StateBytes, state_bytes
from jaxpar.offload.budget import format_bytes, parse_bytes
from jaxpar.placement.execution import OffloadOptions

# PCIe 5.0 x16: 32 GT/s x 16 lanes x 128b/130b = 63 GB/s per direction on the wire;
# pinned-memory copies measure about 50 GB/s, the default (bytes per second, per direction).
PCIE5_X16_BANDWIDTH = 50e9
# Dense bf16 peak of an H100/H200 SXM (989 TFLOP/s), for the compute time.
H100_PEAK_FLOPS = 989e12
# Optimizer-state bytes per second one device's host-side update streams: a host's DRAM
# (~200 GB/s) shared by 8 devices, halved for the 2-3x slowdown measured (axlearn PR#867).
HOST_UPDATE_BANDWIDTH = 10e9

PLACES = ("device", "host", "auto")

# Why an interleaved pipeline or uneven stages do not offload yet (jaxpar.train.step and
# the config refuse them; the layout planner prunes them).
REORDERED_STAGES = ("an interleaved pipeline's (or uneven stages') layers are stored reordered, which "
                    "host-resident state is not yet")

# Why a pipeline's layers are placed whole (jaxpar.train.step refuses the same split).
WHOLE_STAGES = ("a pipeline's stages hold their layers whole, all on the device or all in host memory "
                "(the resident ones would be the first stage's)")

# Plan.device's parts, as the nothing-fits message names them.
DEVICE_PARTS = {
    "params": "the device-resident parameters",
    "optimizer": "the device-resident optimizer state",
    "fetched": "the fetched chunks of host parameters",
    "gradients": "the gradients",
    "update": "the host state brought to the device for the optimizer update",
    "temporaries": "the step's compiled temporaries",
    "activations": "the activations kept on the device",
    "inputs_outputs": "the batch and the step's outputs",
}

class PlanError(InputError):
    """No plan fits the budget; the message is one line naming the smallest budget that
    works and what dominates it. ``smallest``: that plan."""

    def __init__(self, message: str, smallest: Plan):
        super().__init__(message)
        self.smallest = smallest


@dataclasses.dataclass(frozen=True)
class Plan:
    """A resolved offload plan and what it costs, per device.

    options: the ``OffloadOptions`` a step is built with (no ``auto``).
    layers / resident_layers: ``L`` and how many keep their parameters on the device
      (``L`` with ``params=device``).
    prefetch: the fetch distance, in layers.
    grad_accum: the microbatches per step the transfers and gradients count.
    budget: the device budget it was chosen under (None: unlimited).
    device: bytes on the device at the step's peak, by part (module docstring);
      ``device_bytes`` their sum, the figure promised to stay within ``budget``.
    host: bytes in host memory at the step's peak: ``params``, ``optimizer``,
      ``gradients`` (the host layers' gradients, and with ``optimizer=host`` the device
      parameters' sent for the update), ``activations`` (offloaded residuals, between
      the forward and the backward).
    host_to_device / device_to_host: bytes moved per step, each direction.
    compute_s / step_s: predicted compute time and step time (module docstring).
    assumptions: the rates the prediction used.
    """

    options: OffloadOptions
    layers: int
    resident_layers: int
    prefetch: int
    grad_accum: int
    budget: int | None
    device: dict[str, int]
    host: dict[str, int]
    host_to_device: int
    device_to_host: int
    compute_s: float
    step_s: float
    assumptions: dict[str, Any]

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_state_bytes(self) -> int:
        """Parameters and optimizer state that live on the device between steps."""
        return self.device["params"] + self.device["optimizer"]

    @property
    def between_steps_bytes(self) -> int:
        """The most that live device arrays hold between steps: the device-resident state
        and the batch and outputs (``inputs_outputs``); ``device_live_bytes`` after a step
        stays within it."""
        return self.device_state_bytes + self.device["inputs_outputs"]

    @property
    def host_state_bytes(self) -> int:
        """Parameters and optimizer state that live on the host between steps."""
        return self.host["params"] + self.host["optimizer"]

    @property
    def fits(self) -> bool:
        return self.budget is None or self.device_bytes <= self.budget

    def summary(self) -> str:
        """``params=host resident_layers=3/16 optimizer=host activations=[query]``."""
        o = self.options
        text = f"params={o.params}"
        if o.params == "host":
            text += f" resident_layers={self.resident_layers}/{self.layers} prefetch={o.prefetch}"
        text += f" optimizer={o.optimizer}"
        if o.activations:
            text += f" activations=[{','.join(o.activations)}]"
        return text

    def dominant(self) -> tuple[str, int]:
        """The largest part of ``device``: ``(name, bytes)``."""
        return max(self.device.items(), key=lambda item: item[1])

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``dry_run``'s ``offload_plan``)."""
        o = self.options
        return {
            "params": o.params, "resident_layers": self.resident_layers, "layers": self.layers,
            "optimizer": o.optimizer, "activations": list(o.activations), "prefetch": o.prefetch,
            "grad_accum": self.grad_accum,
            "budget_bytes": self.budget, "device_bytes": self.device_bytes, "device": dict(self.device),
            "host_bytes": self.host_bytes, "host": dict(self.host),
            "host_to_device_bytes": self.host_to_device, "device_to_host_bytes": self.device_to_host,
            "compute_s": self.compute_s, "step_s": self.step_s, "assumptions": dict(self.assumptions),
        }

    def describe(self) -> str:
        """Several lines for people: the placement, the device bytes by part, the moves."""
        budget = "unlimited" if self.budget is None else format_bytes(self.budget)
        lines = [f"offload plan: {self.summary()}",
                 f"  device {format_bytes(self.device_bytes)} of {budget} per device:"]
        lines += [f"    {name:<20} {format_bytes(n)}" for name, n in self.device.items() if n]
        lines.append(f"  host {format_bytes(self.host_bytes)}: "
                     + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host.items()))
        lines.append(f"  per step: host->device {format_bytes(self.host_to_device)}, "
                     f"device->host {format_bytes(self.device_to_host)}; predicted "
                     f"{self.step_s * 1e3:.3g} ms (compute {self.compute_s * 1e3:.3g} ms)")
        return "\n".join(lines)


def plan(
    abstract_state: Mapping,
    mesh: jax.sharding.Mesh | None,
    profile: Mapping[str, Any],
    budget: int | str | None,
    *,
    params: str = "auto",
    optimizer: str = "auto",
    activations: Collection[str] = (),
    resident_layers: int | None = None,
    prefetch: int = 1,
    grad_accum: int = 1,
    host_bandwidth: float | str = PCIE5_X16_BANDWIDTH,
    peak_flops: float = H100_PEAK_FLOPS,
    host_update_bandwidth: float | str = HOST_UPDATE_BANDWIDTH,
    activation_bytes: Mapping[str, int] | None = None,
    saved_names: Collection[str] = (),
    layers_key: str = "layers",
    budget_source: str | None = None,
) -> Plan:
    """The fastest plan whose device bytes fit ``budget`` (module docstring: inputs,
    accounting, transfers, time, and where it is conservative).

    Args:
      abstract_state: ``{"params", "opt_state"}`` with the step's shardings.
      mesh: the step's mesh (None: one device); with a ``pipe`` axis of size > 1 the
        layers are placed whole (all resident or none: each stage holds its own, which
        its schedule fetches), a ``resident_layers`` between refused.
      profile: ``jaxpar.profiler.profile`` of the all-on-device step; None only where
        the plan is ``decided`` without it (one candidate, no budget), so a run need not
        compile the all-on-device step to learn its options: the profile's figures (the
        working temporaries, the batch and outputs, the compute time) then count 0 in
        ``Plan.device`` and the predicted times.
      budget: device bytes per device (an int or ``"6GiB"``); None: no limit.
      params, optimizer: ``device``, ``host`` or ``auto`` (searched).
      activations: ``checkpoint_name``s whose residuals go to the host (given, not searched).
      resident_layers: fixes the count of device-resident layers (``params`` host/auto).
      prefetch: layers fetched ahead (>= 1).
      grad_accum: microbatches per step (>= 1).
      host_bandwidth: host<->device bytes/s per direction (default ``PCIE5_X16_BANDWIDTH``).
      peak_flops: the device's FLOP/s for the compute time (default ``H100_PEAK_FLOPS``).
      host_update_bandwidth: optimizer bytes/s a host-side update streams per device.
      activation_bytes: per-device bytes of each name's residuals over all layers of one
        step; required for every name in ``activations``.
      saved_names: names whose residuals the profiled step keeps on the device (only
        these free device bytes when offloaded).
      layers_key: the path key of stacked layer arrays.
      budget_source: how the nothing-fits message names the budget (default "a device
        budget of 6GiB").

    Raises:
      PlanError: nothing fits (one line: the smallest budget that works, what dominates it).
      ValueError: a bad argument, a mesh / state the plan cannot describe, or no profile
        where the plan weighs candidates or checks a budget.
    """
    limit, rates = _checked(params, optimizer, prefetch, grad_accum, budget, host_bandwidth,
                            host_update_bandwidth, peak_flops)
    activations = tuple(activations)
    sizes = dict(activation_bytes or {})
    if missing := [n for n in activations if n not in sizes]:
        raise ValueError(f"plan: activation_bytes gives no size for offloaded activations {missing}")
    state = state_bytes(abstract_state, layers_key=layers_key)
    L = state.layers
    whole = _check_resident(resident_layers, L, mesh)
    if L == 0 and params != "device":
        params = "device"  # nothing stacked to fetch layer by layer
    opt_places = ("device", "host") if optimizer == "auto" else (optimizer,)
    choices = [(place, r, opt) for place, r in _placements(params, resident_layers, L, limit)
               for opt in opt_places if not (whole and place == "host" and r > 0)]
    if profile is None:  # only where it decides nothing (``decided``)
        if limit is not None or len(choices) != 1:
            raise ValueError("plan: without a profile, only one placement and no budget (decided)")
        profile = {}
    candidates = [_cost(state, profile, limit, place, r, opt, activations, prefetch, grad_accum, sizes,
                        set(saved_names), rates) for place, r, opt in choices]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _nothing_fits(candidates, budget_source or f"a device budget of {format_bytes(limit)}")
    return min(fitting, key=lambda c: (c.step_s, c.host_to_device + c.device_to_host, -c.resident_layers))


def decided(
    abstract_state: Mapping,
    budget: int | str | None,
    *,
    params: str = "auto",
    optimizer: str = "auto",
    resident_layers: int | None = None,
    layers_key: str = "layers",
) -> bool:
    """Whether ``plan`` with these arguments has nothing to weigh: one candidate (the
    parameters' and the optimizer's placements fixed, not ``auto``; the resident layer
    count given, or implied: every layer with ``params=device``, none with ``params=host``
    and no budget) and no budget to check. Its options then do not depend on the profile,
    and ``plan`` takes ``profile=None``. False for arguments ``plan`` refuses (it says why)."""
    if budget is not None or optimizer not in ("device", "host") or params not in PLACES:
        return False
    try:
        L = state_bytes(abstract_state, layers_key=layers_key).layers
    except ValueError:  # a state plan cannot describe: it raises
        return False
    if resident_layers is not None and not 0 <= resident_layers <= L:
        return False
    return len(_placements(params if L else "device", resident_layers, L, None)) == 1


def _nothing_fits(candidates: list[Plan], what: str) -> PlanError:
    """The one-line error when no candidate fits ``what`` (the budget, as the user gave it):
    the smallest plan, its bytes, and what dominates them."""
    smallest = min(candidates, key=lambda c: (c.device_bytes, c.step_s))
    part, nbytes = smallest.dominant()
    return PlanError(
        f"{what} is below what any plan needs: the smallest ({smallest.summary()}) needs "
        f"{format_bytes(smallest.device_bytes)} per device ({smallest.device_bytes} bytes), most "
        f"of it {DEVICE_PARTS[part]} ({format_bytes(nbytes)})", smallest)


def _check_resident(resident_layers: int | None, L: int, mesh) -> bool:
    """Whether ``mesh`` places the layers whole (a pipeline); a ValueError line where
    ``resident_layers`` cannot be."""
    if resident_layers is not None and not 0 <= resident_layers <= L:
        raise ValueError(f"offload.resident_layers={resident_layers} must be between 0 and the "
                         f"model's {L} stacked layers")
    whole = mesh is not None and mesh.shape.get("pipe", 1) > 1
    if whole and resident_layers not in (None, 0):
        raise ValueError(f"offload.resident_layers={resident_layers} with mesh.pipe={mesh.shape['pipe']} is not "
                         f"supported yet: {WHOLE_STAGES}")
    return whole


def _checked(params, optimizer, prefetch, grad_accum, budget, host_bandwidth, host_update_bandwidth,
             peak_flops) -> tuple[int | None, dict[str, float]]:
    """``plan``'s argument checks (a ValueError naming the value): the budget in bytes
    (None: no limit) and the rates ``_cost`` takes."""
    for name, value in (("params", params), ("optimizer", optimizer)):
        if value not in PLACES:
            raise ValueError(f"offload.{name}={value!r} must be one of {list(PLACES)}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"offload.prefetch={prefetch!r} must be an int >= 1")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"optimizer.grad_accum={grad_accum!r} must be an int >= 1")
    limit = None if budget is None else parse_bytes(budget, name="offload.device_budget")
    bandwidth = float(parse_bytes(host_bandwidth, name="offload.host_bandwidth")
                      if isinstance(host_bandwidth, str) else host_bandwidth)
    update_bandwidth = float(parse_bytes(host_update_bandwidth, name="host_update_bandwidth")
                             if isinstance(host_update_bandwidth, str) else host_update_bandwidth)
    for name, rate in (("offload.host_bandwidth", bandwidth), ("host_update_bandwidth", update_bandwidth),
                       ("peak_flops", peak_flops)):
        if not rate > 0:
            raise ValueError(f"{name}={rate!r} must be positive")
    return limit, {"host_bandwidth": bandwidth, "peak_flops": float(peak_flops),
                   "host_update_bandwidth": update_bandwidth}


def _placements(params: str, resident_layers: int | None, L: int, limit: int | None) -> list[tuple[str, int]]:
    """The parameters' placements ``plan`` weighs: ``(place, resident layer count)``."""
    placements = []  # (params place, resident count)
    if params in ("device", "auto") and (resident_layers is None or resident_layers == L):
        placements.append(("device", L))
    if params in ("host", "auto"):
        counts = range(L + 1 if params == "host" else L) if resident_layers is None else [resident_layers]
        placements += [("host", r) for r in counts if params == "host" or r < L]
    if params == "host" and resident_layers is None and limit is None:
        placements = [("host", 0)]  # OffloadOptions' meaning of params=host alone: no layer resident
    return placements


def _cost(state: StateBytes, profile: Mapping, budget: int | None, place: str, resident: int,
          optimizer: str, activations: tuple[str, ...], prefetch: int, k: int, sizes: Mapping[str, int],
          saved: set[str], rates: Mapping[str, float]) -> Plan:
    """One candidate's ``Plan``: the module docstring's formulas, term by term."""
    L = state.layers
    H = L - resident  # host layers
    p = state.layer_params  # a layer's gradients are as big: same shapes, dtypes, shardings
    host_params = place == "host"
    opt_on_device = optimizer == "device"
    E = state.other_params
    params_device = resident * p + (0 if host_params else E)
    params_host = state.params - params_device  # P_h, and G_h: their gradients
    f = min(prefetch, H)

    saved_total = sum(n for name, n in sizes.items() if name in saved)
    offloaded = sum(sizes[name] for name in activations)
    # a host layer's input stays on the device whatever the policy: the streamed scan's residual
    freed = sum(sizes[name] * (resident / L if name == "layer_input" and L else 1)
                for name in activations if name in saved)
    per_layer_act = offloaded / L if L else offloaded
    temp = int(profile.get("temp_bytes") or 0)
    inputs = max(int(profile.get("argument_bytes") or 0) - state.total, 0)
    outputs = int(profile.get("output_bytes") or 0) - int(profile.get("alias_bytes") or 0)

    whole_gradients = 1  # in the profile's temp_bytes
    if host_params:
        fetched = f * p + max(p if H else 0, state.chunk_in, state.chunk_out)
        in_flight = sum(sorted([state.chunk_in, state.chunk_out] + [p] * min(H, 2))[-2:])
        gradients = resident * p * (1 if k == 1 else 2) + in_flight
        update = 2 * params_host if opt_on_device else 0
        whole_gradients = 1 if k == 1 else 2
    else:
        fetched, update, gradients = 0, 0, state.params
    device = {
        "params": params_device,
        "optimizer": state.optimizer if opt_on_device else 0,
        "fetched": fetched,
        "gradients": gradients,
        "update": update,
        "temporaries": max(temp - whole_gradients * state.params - saved_total, 0),
        "activations": math.ceil(saved_total - freed + min(prefetch + 1, max(L, 1)) * per_layer_act),
        "inputs_outputs": inputs + max(outputs, 0),
    }
    host = {"params": params_host, "optimizer": 0 if opt_on_device else state.optimizer,
            "gradients": (params_host if host_params else 0) + (0 if opt_on_device else params_device),
            "activations": offloaded}

    # Per microbatch outside the layer loops: window fills and the other chunks.
    fills_h2d = (2 * f * p + state.other_fetched) if host_params else 0
    fills_d2h = state.other_sent if host_params else 0
    if opt_on_device:
        update_h2d = params_host * (2 if host_params else 1)
        update_d2h = params_host
    else:  # the device parameters' gradients and the parameters out, the parameters back
        update_h2d, update_d2h = params_device, 2 * params_device
    h2d = k * (2 * H * p + fills_h2d + offloaded) + update_h2d
    d2h = k * (H * p + fills_d2h + offloaded) + update_d2h

    bw = rates["host_bandwidth"]
    flops_time = float(profile.get("flops") or 0.0) / rates["peak_flops"]
    c = flops_time / L if L else flops_time
    a = k * per_layer_act
    resident_layer = max(c / 3, a / bw) + max(2 * c / 3, a / bw)
    host_layer = max(c / 3, k * p / bw, a / bw) + max(c, (k * p + a) / bw)
    step = H * host_layer + resident * resident_layer + (0 if L else flops_time)
    step += k * max(fills_h2d, fills_d2h) / bw + max(update_h2d, update_d2h) / bw
    if not opt_on_device:
        step += (3 * state.params + 2 * state.optimizer) / rates["host_update_bandwidth"]
    if host_params and k > 1:
        step += 3 * k * params_host / rates["host_update_bandwidth"]

    options = OffloadOptions(params=place, resident_layers=resident if host_params else None,
                             optimizer=optimizer, activations=activations, prefetch=prefetch)
    return Plan(options, L, resident, prefetch, k, budget, device, host, int(h2d), int(d2h),
                flops_time + H * c / 3, step, dict(rates))
