"""Host offload (``jaxpar.offload``, issue 18): how large a model fits a device budget
with and without it, what its mechanism costs per step, and where a plan's device bytes
go over one step.

    python bench/offload.py capacity [--config 1b] [--meshes fsdp=8 single]
        [--budgets 4GiB 8GiB 16GiB] [--remats shipped full] [--max-layers 4096]
        [--no-accumulate] [--set KEY=VALUE ...] [--cache PATH] [--json PATH]
    python bench/offload.py overhead [--configs tiny small] [--small-layers 4]
        [--steps 4] [--rounds 3] [--batch B] [--seq-len T] [--json PATH]
    python bench/offload.py picture [--config 1b] [--mesh fsdp=8] [--budget 4GiB]
        [--set KEY=VALUE ...] [--png PATH] [--json PATH]

``capacity`` (compile-only, 8 simulated CPU devices): for each mesh, remat policy and
budget, the largest model whose device bytes fit the budget per device, without offload
(the all-on-device compile's ``peak_bytes``) and with it (the device bytes of the plan
``jaxpar.train.offload.resolve`` chooses with ``offload.params=auto
offload.optimizer=auto``, exactly what ``dry_run=true`` prints as
``offload_plan.device_bytes``). The model grows by ``model.layers`` at the config's
width; only when not even one layer fits does the width (``model.dim``, with heads,
kv heads and ``mlp_dim`` in proportion) shrink, and the layers grow at that width.
Each model shape is compiled once (the all-on-device step; the planner reads its
profile) and the search interpolates linearly between measured layer counts,
verifying every answer ``L`` by compiling ``L`` and ``L + 1``. The batch is the
config's, in microbatches of one row per device (``optimizer.grad_accum``), so the
activations are those of one 2048-token row; with ``--no-accumulate`` the batch is one
row per device, without accumulation.

``overhead`` (one CPU device): step time of real training steps with each offload mode
beside none. On a CPU host and device memory are the same RAM and the memory-kind
moves inside a step lower to nothing, so this measures the mechanism's own cost
(the layer fetch's restructured scan, the host update), not PCIe.

``picture``: one plan's device bytes over the step, forward layer by layer, backward,
then the update, by part (``Plan.device``), beside the all-on-device step's, with the
budget line; a PNG (matplotlib: ``pip install -e '.[bench]'``).

The planner is read only through its public API (``resolve``, ``Plan``,
``state_bytes``): rerunning the script after a change to the planner's accounting
updates every figure (``--cache`` keeps only compile profiles, never plans).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import jax

if __name__ == "__main__" and len(sys.argv) > 1:  # before a backend starts
    # 8 simulated devices for the compile-only parts, 1 for the timed one.
    jax.config.update("jax_num_cpu_devices", 1 if sys.argv[1] == "overhead" else 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.offload import OffloadOptions, format_bytes, parse_bytes  # noqa: E402
from jaxpar.offload.accounting import state_bytes  # noqa: E402
from jaxpar.train import offload as offload_lib  # noqa: E402
from jaxpar.train.config import Config, ConfigError, load_config  # noqa: E402
from jaxpar.train.loop import (build_mesh, build_model, dry_run_profile, make_optimizer,  # noqa: E402
                               peak_flops)
from jaxpar.train.step import make_train_step  # noqa: E402
from jaxpar.models import PRESETS, Transformer  # noqa: E402
from jaxpar.models.transformer import sharding_rules  # noqa: E402

GiB = 1 << 30


# ---------------------------------------------------------------- capacity (compile-only)

def mesh_overrides(mesh: str) -> tuple[list[str], int]:
    """``fsdp=8`` or ``single`` -> (config overrides, device count)."""
    if mesh == "single":
        return ["mesh.data=1"], 1
    axis, _, n = mesh.partition("=")
    if axis not in ("fsdp", "data") or not n.isdigit():
        raise SystemExit(f"--meshes: {mesh!r} is not 'single', 'fsdp=N' or 'data=N'")
    other = "data" if axis == "fsdp" else "fsdp"
    return [f"mesh.{axis}={n}", f"mesh.{other}=1"], int(n)


def width_overrides(dim: int) -> list[str]:
    """``model.dim=dim`` with 64-wide heads, a quarter as many kv heads, mlp 4 x dim."""
    heads = dim // 64
    return [f"model.dim={dim}", f"model.heads={heads}", f"model.kv_heads={max(1, heads // 4)}",
            "model.head_dim=64", f"model.mlp_dim={4 * dim}"]


class Profiles:
    """All-on-device compile-only profiles, one compile per model shape.

    ``cache``: a JSON file of profiles kept across runs (keyed by the overrides and
    JAX's version); plans are never cached, so the planner's current accounting always
    applies."""

    def __init__(self, cache: pathlib.Path | None = None):
        self.cache = cache
        self.memo = json.loads(cache.read_text()) if cache and cache.exists() else {}
        self.entries = {}  # this run's, with the abstract state and mesh
        self.compiles = 0
        self.compile_s = 0.0

    def get(self, config: str, overrides: list[str], devices: int) -> dict:
        """``{"cfg", "profile", "abstract_state", "mesh", "rules", "params"}`` of the
        all-on-device step of ``config`` + ``overrides`` on ``devices`` devices."""
        key = json.dumps([config, overrides, devices, jax.__version__])
        if key in self.entries:
            return self.entries[key]
        cfg = load_config(config, overrides)
        mesh = build_mesh(cfg, devices=jax.devices()[:devices])
        rules = sharding_rules(cfg.model, mesh, sequence_parallel=cfg.layout.sequence_parallel)
        abstract_model = nnx.eval_shape(lambda: build_model(cfg))
        tx, _ = make_optimizer(cfg.optimizer, cfg.steps)
        step = make_train_step(abstract_model, tx, mesh, rules, grad_accum=cfg.layout.grad_accum,
                               sequence=cfg.layout.sequence(cfg.execution.seq_layout), kernels=cfg.execution.kernels)
        if key not in self.memo:
            began = time.perf_counter()
            self.memo[key] = dry_run_profile(cfg, step, abstract_model, mesh, rules, None)
            self.compile_s += time.perf_counter() - began
            self.compiles += 1
            if self.cache:
                self.cache.parent.mkdir(parents=True, exist_ok=True)
                self.cache.write_text(json.dumps(self.memo))
        params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract_model, nnx.Param)))
        self.entries[key] = {"cfg": cfg, "profile": self.memo[key], "mesh": mesh, "rules": rules,
                             "abstract_state": step.abstract_state(abstract_model), "params": params}
        return self.entries[key]

    def compiled_layers(self, config: str, base: list[str], devices: int) -> list[int]:
        """The layer counts already compiled for ``config`` + ``base`` (nothing else
        overridden) on ``devices`` devices."""
        found = []
        for key in self.memo:
            name, overrides, n, _ = json.loads(key)
            layers = [o for o in overrides if o.startswith("model.layers=")]
            if name == config and n == devices and layers and [o for o in overrides if o not in layers] == base:
                found.append(int(layers[0].split("=")[1]))
        return sorted(found)


def with_offload(cfg: Config, budget: int, **offload) -> Config:
    """``cfg`` with an ``offload`` section under ``budget`` (default: both ``auto``)."""
    section = {"params": "auto", "optimizer": "auto", **offload}
    layout = dataclasses.replace(cfg.layout, offload_params=section.pop("params"),
                                 offload_optimizer=section.pop("optimizer"))
    return dataclasses.replace(cfg, layout=layout, offload=dataclasses.replace(cfg.offload, device_budget=budget,
                                                                                **section))


def planned(entry: dict, budget: int, **offload):
    """The plan ``jaxpar-train ... offload.params=auto offload.optimizer=auto
    offload.device_budget=budget`` chooses (None: no plan fits)."""
    try:
        return offload_lib.resolve(with_offload(entry["cfg"], budget, **offload), entry["profile"],
                                   entry["abstract_state"], entry["mesh"], entry["rules"], peak_flops())
    except ConfigError:
        return None


def device_bytes(entry: dict, budget: int, offload: bool) -> tuple[int, bool]:
    """``(bytes, fits)``: without offload the all-on-device compile's peak; with it the
    device bytes of the plan chosen under ``budget``, or where none fits, of the least
    plan (everything on the host, no layer resident) for the search to interpolate."""
    if not offload:
        peak = entry["profile"]["peak_bytes"]
        return peak, peak <= budget
    plan = planned(entry, budget)
    if plan is not None:
        return plan.device_bytes, True
    least = planned(entry, 1 << 62, params="host", optimizer="host", resident_layers=0)
    return max(least.device_bytes, budget + 1), False


def largest(fits, measured: dict[int, int], lo: int, hi: int, target: int) -> int:
    """The largest ``n`` in ``[lo, hi]`` with ``fits(n)``, ``lo - 1`` if none; ``fits``
    is monotone (true up to some ``n``) and records ``n -> bytes`` in ``measured``,
    whose linear interpolation at ``target`` bytes picks the next ``n`` to try; each
    answer is confirmed by its neighbour, so a linear ``bytes(n)`` costs about two
    probes beyond those already measured."""
    good, bad = lo - 1, hi + 1  # fits(good) or good == lo - 1; not fits(bad) or bad == hi + 1
    for n in sorted(measured):
        if lo <= n <= hi:
            if fits(n):
                good = max(good, n)
            else:
                bad = min(bad, n)
    guesses = 0
    while bad - good > 1:
        guess = _interpolate(measured, good, bad, target) if guesses < 4 else None
        if guess is None:
            guess = lo if good < lo else min(hi, 2 * good) if bad > hi else (good + bad) // 2
        guess = min(max(guess, good + 1), bad - 1)
        guesses += 1
        if fits(guess):
            good = guess
            if good + 1 < bad:
                good, bad = (good + 1, bad) if fits(good + 1) else (good, good + 1)
        else:
            bad = guess
            if bad - 1 > good:
                good, bad = (bad - 1, bad) if fits(bad - 1) else (good, bad - 1)
    return good


def _interpolate(measured: dict[int, int], good: int, bad: int, target: int) -> int | None:
    """Where the line through the two measured points nearest the boundary between
    ``good`` and ``bad`` reaches ``target`` bytes (None: fewer than two points, or no
    growth)."""
    below = sorted(n for n in measured if n <= good)
    above = sorted(n for n in measured if n >= bad)
    points = (below[-1:] + above[:1]) if below and above else below[-2:] if len(below) >= 2 else above[:2]
    if len(points) < 2:
        return None
    (n0, n1) = points
    slope = (measured[n1] - measured[n0]) / (n1 - n0)
    return None if slope <= 0 else n0 + math.floor((target - measured[n0]) / slope)


def largest_model(profiles: Profiles, config: str, base: list[str], devices: int, budget: int,
                  offload: bool, max_layers: int) -> dict | None:
    """The largest model of ``config`` + ``base`` fitting ``budget`` (None: none):
    most layers at the config's width; where not even one layer fits, the widest width
    (steps of 256) one layer fits, then most layers of that width. With ``offload``,
    ``plan`` is the plan chosen for it (``Plan.to_dict``)."""
    base_dim = load_config(config, base).model.dim

    def width(dim: int) -> list[str]:
        return [] if dim == base_dim else width_overrides(dim)

    def entry(layers: int, dim: int) -> dict:
        return profiles.get(config, [*base, *width(dim), f"model.layers={layers}"], devices)

    def most_layers(dim: int) -> int:
        measured = {n: device_bytes(entry(n, dim), budget, offload)[0]  # other searches' compiles
                    for n in profiles.compiled_layers(config, [*base, *width(dim)], devices)}

        def fits(n: int) -> bool:
            measured[n], ok = device_bytes(entry(n, dim), budget, offload)
            return ok

        return largest(fits, measured, 1, max_layers, budget)

    dim = base_dim
    layers = most_layers(dim)
    if layers < 1:  # then narrower: the widest that one layer fits, then as many layers of it
        k = largest(lambda i: device_bytes(entry(1, 256 * i), budget, offload)[1], {}, 1,
                    base_dim // 256 - 1, budget)
        if k < 1:
            return None
        dim = 256 * k
        layers = most_layers(dim)
    e = entry(layers, dim)
    return {"layers": layers, "dim": dim, "params": e["params"],
            "device_bytes": device_bytes(e, budget, offload)[0], "capped": layers == max_layers,
            "plan": planned(e, budget).to_dict() if offload else None}


def capacity(args) -> dict:
    """The capacity table's rows (module docstring)."""
    profiles = Profiles(args.cache)
    began = time.perf_counter()
    rows = []
    for mesh in args.meshes:
        mesh_ov, devices = mesh_overrides(mesh)
        cfg0 = load_config(args.config, mesh_ov)
        batch = [f"optimizer.grad_accum={max(1, cfg0.batch_size // devices)}"] if args.accumulate else [
            f"batch_size={devices}", "optimizer.grad_accum=1"]
        for remat in args.remats:
            base = [*mesh_ov, *batch, *args.set]
            if remat != "shipped":
                base.append(f"model.remat={remat}")
            for budget_text in args.budgets:
                budget = parse_bytes(budget_text, name="--budgets")
                found = {}
                for offload in (False, True):
                    found["with" if offload else "without"] = largest_model(
                        profiles, args.config, base, devices, budget, offload, args.max_layers)
                row = {"config": args.config, "mesh": mesh, "remat": remat if remat != "shipped" else
                       f"{cfg0.layout.remat} (shipped)", "overrides": base, "budget": budget_text,
                       "budget_bytes": budget, "devices": devices, **found}
                w, o = found["without"], found["with"]
                row["ratio"] = (o["params"] / w["params"]) if w and o else None
                rows.append(row)
                print(_capacity_line(row), flush=True)
    return {"rows": rows, "compiles": profiles.compiles, "compile_s": round(profiles.compile_s, 1),
            "seconds": round(time.perf_counter() - began, 1)}


def _model_text(found: dict | None, cfg_dim: int) -> str:
    if found is None:
        return "nothing fits"
    width = "" if found["dim"] == cfg_dim else f" of dim {found['dim']}"
    capped = " (the cap)" if found["capped"] else ""
    layers = f"{found['layers']} layer{'s' if found['layers'] != 1 else ''}"
    return f"{layers}{capped}{width}, {found['params'] / 1e6:,.0f}M"


def _capacity_line(row: dict) -> str:
    dim = load_config(row["config"], []).model.dim
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
    plan = row["with"] and row["with"]["plan"]
    summary = "-" if plan is None else (
        f"params={plan['params']} resident={plan['resident_layers']}/{plan['layers']} "
        f"optimizer={plan['optimizer']}; {format_bytes(plan['device_bytes'])}")
    host = "-" if plan is None else format_bytes(plan["host_bytes"] * row["devices"])
    return (f"| {row['mesh']} | {row['remat']} | {row['budget']} | {_model_text(row['without'], dim)} | "
            f"{_model_text(row['with'], dim)} | {ratio} | {summary} | {host} |")


# ---------------------------------------------------------------- overhead (CPU, timed)

MODES = {
    "none": OffloadOptions(),
    "params=host": OffloadOptions(params="host"),
    "optimizer=host": OffloadOptions(optimizer="host"),
    "both": OffloadOptions(params="host", optimizer="host"),
    "partial": None,  # params=host with half the layers resident (filled per model)
    "activations": OffloadOptions(activations=("layer_input",)),
}


def overhead(args) -> dict:
    """Median step time of each mode (module docstring), rounds alternating the modes
    so the machine's noise hits all alike."""
    rows = []
    for name in args.configs:
        cfg = PRESETS[name]
        batch, seq = (16, 128) if name == "tiny" else (2, 128)
        batch, seq = args.batch or batch, args.seq_len or seq
        if name != "tiny":
            cfg = dataclasses.replace(cfg, layers=args.small_layers)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, cfg.vocab_size, (args.steps, batch, seq + 1)).astype(np.int32)
        batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
        mesh = build_mesh(load_config("tiny"), devices=jax.devices()[:1])
        runs = {}
        for mode in args.modes:
            options = MODES[mode] or OffloadOptions(params="host", resident_layers=cfg.layers // 2)
            model = Transformer(cfg, rngs=nnx.Rngs(0))
            step = make_train_step(model, optax.adamw(1e-3), mesh, offload=options)
            state = list(step.init(model))
            began = time.perf_counter()
            state[0], state[1], out = step(state[0], state[1], batches[0])  # compile + one step
            float(out["loss"])
            runs[mode] = {"step": step, "state": state, "options": options, "times": [],
                          "compile_s": time.perf_counter() - began}
        for _ in range(args.rounds):
            for mode, run in runs.items():
                for batch_ in batches:
                    began = time.perf_counter()
                    run["state"][0], run["state"][1], out = run["step"](*run["state"], batch_)
                    float(out["loss"])
                    run["times"].append(time.perf_counter() - began)
        base = statistics.median(runs["none"]["times"]) if "none" in runs else None
        for mode, run in runs.items():
            median = statistics.median(run["times"])
            rows.append({"model": name, "layers": cfg.layers, "batch": batch, "seq_len": seq, "mode": mode,
                         "options": dataclasses.asdict(run["options"]),
                         "step_s": median, "steps_timed": len(run["times"]),
                         "vs_none": None if base is None else median / base,
                         "compile_s": round(run["compile_s"], 1)})
            print(f"| {name} ({cfg.layers} layers, {batch}x{seq}) | {mode} | {median * 1e3:,.1f} | "
                  f"{'-' if base is None else f'{median / base:.2f}'} |", flush=True)
        del runs
    return {"rows": rows}


# ---------------------------------------------------------------- picture

def timeline(plan, layer_params: int, other_params: int) -> list[tuple[str, dict[str, int]]]:
    """``plan``'s device bytes at each moment of one step, by part: forward layer
    ``0..L-1``, backward ``L-1..0``, then the update. Each part of ``plan.device`` is
    at its full size where the plan counts it, so the maximum over the step is at most
    ``plan.device_bytes``: state, temporaries, batch and outputs all the step; the
    fetched chunks (the layer window, the embedding and head) over the forward and
    backward; gradients from the backward on (the head's and embedding's, resident
    layers' as the backward passes them, the chunks in flight while in host layers);
    saved activations grow over the forward and shrink over the backward; host state
    brought in for a device-side update at the update."""
    d = dict(plan.device)
    L, r = plan.layers, plan.resident_layers
    timed = ("fetched", "gradients", "activations", "update")
    always = {k: v for k, v in d.items() if k not in timed}  # and any part not modelled here
    fetched, saved = d.get("fetched", 0), d.get("activations", 0)
    resident_grads = min(d.get("params", 0), d.get("gradients", 0))  # the device-resident params'
    in_flight = d.get("gradients", 0) - resident_grads  # the host layers' chunks in flight
    moments = []
    for i in range(L):
        moments.append((f"F{i}", {**always, "fetched": fetched, "activations": saved * (i + 1) // L}))
    for i in reversed(range(L)):
        done = other_params + (r - min(i, r)) * layer_params  # head, embedding, resident layers passed
        moments.append((f"B{i}", {**always, "fetched": fetched,
                                  "gradients": min(done, resident_grads) + (in_flight if i >= r else 0),
                                  "activations": saved * i // L}))
    moments.append(("update", {**always, "gradients": resident_grads, "update": d.get("update", 0)}))
    return moments


PART_COLORS = {"params": "#1f77b4", "optimizer": "#aec7e8", "gradients": "#ff7f0e", "fetched": "#2ca02c",
               "update": "#98df8a", "temporaries": "#9467bd", "activations": "#c5b0d5",
               "inputs_outputs": "#8c564b"}


def picture(args) -> dict:
    """Two plans for one model: all on the device, and the planner's under the budget."""
    mesh_ov, devices = mesh_overrides(args.mesh)
    cfg0 = load_config(args.config, mesh_ov)
    accum = max(1, cfg0.batch_size // devices)
    overrides = [*mesh_ov, f"optimizer.grad_accum={accum}", *args.set]
    entry = Profiles(args.cache).get(args.config, overrides, devices)
    budget = parse_bytes(args.budget, name="--budget")
    on_device = (planned(entry, budget, params="device", optimizer="device")  # None: over the budget
                 or planned(entry, 1 << 62, params="device", optimizer="device"))
    chosen = planned(entry, budget)
    sizes = state_bytes(entry["abstract_state"])
    panels = [("all on the device", on_device)] + ([("the planner's plan", chosen)] if chosen else [])
    result = {"config": args.config, "mesh": args.mesh, "remat": entry["cfg"].layout.remat,
              "overrides": overrides, "budget": args.budget,
              "budget_bytes": budget, "all_on_device_peak_bytes": entry["profile"]["peak_bytes"],
              "panels": [{"title": title, "plan": plan.to_dict(),
                          "timeline": [{"at": at, **parts} for at, parts in
                                       timeline(plan, sizes.layer_params, sizes.other_params)]}
                         for title, plan in panels]}
    for panel in result["panels"]:
        peak = max(sum(v for k, v in m.items() if k != "at") for m in panel["timeline"])
        print(f"{panel['title']}: params={panel['plan']['params']} resident {panel['plan']['resident_layers']}/"
              f"{panel['plan']['layers']} optimizer={panel['plan']['optimizer']}: promised "
              f"{format_bytes(panel['plan']['device_bytes'])}, timeline peak {format_bytes(peak)}, "
              f"budget {format_bytes(budget)}")
    if args.png:
        draw(result, args.png)
        print(f"wrote {args.png}")
    return result


def draw(result: dict, path: pathlib.Path) -> None:
    """The panels of ``result`` as stacked areas over the step, one row each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = result["panels"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), sharex=True, sharey=True,
                             squeeze=False)
    budget = result["budget_bytes"] / GiB
    for ax, panel in zip(axes[:, 0], panels):
        moments = panel["timeline"]
        x = np.arange(len(moments))
        named = {k for m in moments for k in m if k != "at"}
        parts = [p for p in [*PART_COLORS, *sorted(named - set(PART_COLORS))]
                 if any(m.get(p, 0) for m in moments)]
        ys = [[m.get(p, 0) / GiB for m in moments] for p in parts]
        ax.stackplot(x, ys, labels=[p.replace("_", " ") for p in parts],
                     colors=[PART_COLORS.get(p, "lightgrey") for p in parts], step="mid", alpha=0.9)
        ax.axhline(budget, color="red", lw=2, label=f"budget {result['budget']}")
        ax.axhline(panel["plan"]["device_bytes"] / GiB, color="black", ls="--", lw=1,
                   label=f"plan's promise {format_bytes(panel['plan']['device_bytes'])}")
        L = panel["plan"]["layers"]
        ax.axvline(L - 0.5, color="grey", lw=0.8)
        ax.axvline(2 * L - 0.5, color="grey", lw=0.8)
        p = panel["plan"]
        where = (f"params={p['params']}, {p['resident_layers']}/{L} layers resident, "
                 f"optimizer={p['optimizer']}")
        ax.set_title(f"{panel['title']}: {where}", fontsize=10, loc="left")
        ax.set_ylabel("GiB per device")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[-1, 0]
    L = panels[-1]["plan"]["layers"]
    ticks = [0, L - 1, L, 2 * L - 1, 2 * L]
    ax.set_xticks(ticks, ["F0", f"F{L - 1}", f"B{L - 1}", "B0", "update"], fontsize=8)
    for label, align in zip(ax.get_xticklabels(), ("center", "right", "left", "right", "left")):
        label.set_horizontalalignment(align)
    ax.set_xlabel("the step: forward through layers 0 .. L-1 (F), backward through L-1 .. 0 (B), "
                  "then the optimizer update")
    fig.suptitle(f"{result['config']} ({L} layers, remat={result['remat']}), mesh {result['mesh']}: "
                 "planned device bytes per device over one step", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main

def meta() -> dict:
    return {"command": " ".join(["python", *sys.argv]), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}", "jax": jax.__version__}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capacity", help="largest model per budget, with and without offload")
    cap.add_argument("--config", default="1b")
    cap.add_argument("--meshes", nargs="+", default=["fsdp=8", "single"])
    cap.add_argument("--budgets", nargs="+", default=["4GiB", "8GiB", "16GiB"])
    cap.add_argument("--remats", nargs="+", default=["shipped", "full"],
                     help="'shipped' (the config's model.remat) or a model.remat value")
    cap.add_argument("--max-layers", type=int, default=4096)
    cap.add_argument("--accumulate", action=argparse.BooleanOptionalAction, default=True,
                     help="the config's batch in one-row microbatches (default), or one row per device")
    cap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    cap.add_argument("--cache", type=pathlib.Path, help="keep compile profiles here across runs")
    ovh = sub.add_parser("overhead", help="CPU step time of each offload mode")
    ovh.add_argument("--configs", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    ovh.add_argument("--small-layers", type=int, default=4)
    ovh.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ovh.add_argument("--steps", type=int, default=4, help="steps per round and mode")
    ovh.add_argument("--rounds", type=int, default=3)
    ovh.add_argument("--batch", type=int, help="sequences per step (default: 16 for tiny, 2 for small)")
    ovh.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128)")
    pic = sub.add_parser("picture", help="one plan's device bytes over a step, as a PNG")
    pic.add_argument("--config", default="1b")
    pic.add_argument("--mesh", default="fsdp=8")
    pic.add_argument("--budget", default="4GiB")
    pic.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    pic.add_argument("--png", type=pathlib.Path)
    pic.add_argument("--cache", type=pathlib.Path)
    for p in (cap, ovh, pic):
        p.add_argument("--json", type=pathlib.Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.command == "overhead" and "none" not in args.modes:
        args.modes = ["none", *args.modes]
    if args.command == "capacity":
        print("| mesh | remat | budget / device | largest without offload | largest with offload | "
              "params ratio | plan chosen; its device bytes | its host memory, all devices |")
        print("|---|---|---|---|---|---|---|---|")
    elif args.command == "overhead":
        print("| model | mode | step ms (median) | vs none |")
        print("|---|---|---|---|")
    result = {"meta": meta(), args.command: {"capacity": capacity, "overhead": overhead,
                                             "picture": picture}[args.command](args)}
    if args.command == "capacity":
        r = result["capacity"]
        print(f"{r['compiles']} compiles in {r['compile_s']} s; {r['seconds']} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
