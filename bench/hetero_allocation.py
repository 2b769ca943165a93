"""``pipeline.stage_layers=auto`` on simulated clusters of unequal devices: the predicted
step of the layers allocated by device profile (``jaxpar.planning.stages``) against the
even split, from the planner's cost and memory models only (nothing runs; seconds).

    python bench/hetero_allocation.py [--json bench/results/hetero_allocation.json]
        [--png bench/figures/hetero_allocation.png]

Speed 1 is an H100 (the shipped ``h100`` hardware profile); a "slow" rank runs at 0.5.
Clusters: Sky Computing's setting (Zhu et al. 2022: a 160-layer BERT-large on 64
nodes, 55% faster than even) as 64 devices of ``data`` x ``pipe`` = 2 x 32 and 4 x 16,
every other pipeline rank slow (so the last, which also runs the head, is slow; for
4 x 16 also the other way round, and all equal: what the head alone moves); the
same model on 8 ranks, half slow, of 80 GiB and of 8 GiB; a 7B
Llama-like model on 8 ranks with a quarter slow, and on 4 ranks of 80 and 40 GiB, the
40 GiB ones slow. Each under GPipe and 1F1B with ``M`` = 2P and 4P microbatches of two
rows per data-parallel replica.

Columns: ``speedup`` the predicted step of even over auto's (the schedule played tick
by tick as jaxpar's SPMD pipeline runs it, ``jaxpar.planning.stages.simulate``);
``textbook`` the same ratio by the estimate ``(M - 1) max_s t_s + sum_s t_s`` of an
asynchronous (MPMD) pipeline such as the paper's, for comparison; ``even`` "no" where
the even split does not fit the ranks' memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpar.models.config import ModelConfig  # noqa: E402
from jaxpar.planning import hardware, stages  # noqa: E402
from jaxpar.planning.devices import DeviceProfile  # noqa: E402
from jaxpar.planning.layout import Layout  # noqa: E402
from jaxpar.planning.workload import Workload  # noqa: E402

GIB = 2 ** 30
BERT_160 = ModelConfig(vocab_size=30522, dim=1024, layers=160, heads=16, kv_heads=16, head_dim=64, mlp_dim=4096,
                       norm="layer", mlp="gelu", position="learned", max_position=512, tie_embeddings=True,
                       attention_bias=True, mlp_bias=True, dtype="bfloat16", param_dtype="float32")
LLAMA_7B = ModelConfig(vocab_size=32000, dim=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp_dim=11008,
                       dtype="bfloat16", param_dtype="float32")
REMAT = {"BERT-160": "none", "Llama-7B": "full"}  # each model's remat policy in its runs


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    model: ModelConfig
    model_name: str
    seq_len: int
    data: int
    speeds: tuple[float, ...]
    memories: tuple[int | None, ...]

    @property
    def pipe(self) -> int:
        return len(self.speeds)


def alternate(P: int) -> tuple[float, ...]:
    return tuple(0.5 if r % 2 else 1.0 for r in range(P))


CLUSTERS = (
    Cluster("sky-64: 2 x 32 ranks, half slow", BERT_160, "BERT-160", 512, 2, alternate(32), (80 * GIB,) * 32),
    Cluster("sky-64: 4 x 16 ranks, half slow", BERT_160, "BERT-160", 512, 4, alternate(16), (80 * GIB,) * 16),
    Cluster("sky-64: 4 x 16 ranks, half slow, the last fast", BERT_160, "BERT-160", 512, 4, alternate(16)[::-1],
            (80 * GIB,) * 16),
    Cluster("sky-64: 4 x 16 equal ranks (the head alone)", BERT_160, "BERT-160", 512, 4, (1.0,) * 16,
            (80 * GIB,) * 16),
    Cluster("8 ranks, half slow", BERT_160, "BERT-160", 512, 1, alternate(8), (80 * GIB,) * 8),
    Cluster("8 ranks of 8 GiB, half slow", BERT_160, "BERT-160", 512, 1, alternate(8), (8 * GIB,) * 8),
    Cluster("8 ranks, a quarter slow", LLAMA_7B, "Llama-7B", 2048, 1, (1.0, 1.0, 1.0, 0.5) * 2, (80 * GIB,) * 8),
    Cluster("4 ranks: 80 GiB, 40 GiB slow", LLAMA_7B, "Llama-7B", 2048, 1, (1.0, 1.0, 0.5, 0.5),
            (80 * GIB, 80 * GIB, 40 * GIB, 40 * GIB)),
)
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (2, 4)  # x pipe
PICTURED = ("sky-64: 4 x 16 ranks, half slow", "8 ranks of 8 GiB, half slow")  # GPipe, M = 4P


def textbook(stage_s, M: int) -> float:
    """``(M - 1) max_s t_s + sum_s t_s``: an asynchronous pipeline's step."""
    return (M - 1) * max(stage_s) + sum(stage_s)


def run(hw) -> list[dict]:
    rows = []
    for cluster in CLUSTERS:
        P = cluster.pipe
        for schedule in SCHEDULES:
            for multiple in MICROBATCHES:
                M = multiple * P
                work = Workload(cluster.model, 2 * cluster.data * M, cluster.seq_len)
                layout = Layout(data=cluster.data, pipe=P, schedule=schedule, microbatches=M,
                                remat=REMAT[cluster.model_name])
                model = stages.stage_model(work, layout, hw, devices_per_node=8)
                result = stages.compare(DeviceProfile(cluster.speeds, cluster.memories, source=cluster.name), model)
                fits = result["even_step_s"] is not None
                rows.append({
                    "cluster": cluster.name, "model": cluster.model_name, "layers": cluster.model.layers,
                    "nodes": P * cluster.data, "data": cluster.data, "pipe": P, "schedule": schedule,
                    "microbatches": M, "speeds": list(cluster.speeds),
                    "memories_gib": [None if m is None else m / GIB for m in cluster.memories],
                    **result,
                    "textbook_speedup": (textbook(result["even_stage_s"], M) / textbook(result["auto_stage_s"], M)
                                         if fits else None),
                    "head_layers": model.head_time / model.layer_time,
                })
    return rows


def short(split: list[int]) -> str:
    """``[13, 5, 13, 5, ...]`` for long splits: the first six and the last two."""
    return str(split) if len(split) <= 8 else f"[{', '.join(map(str, split[:6]))}, ..., {split[-2]}, {split[-1]}]"


def table(rows: list[dict]) -> str:
    lines = ["| cluster | model | schedule | M | even split | auto split | even step | auto step | speedup | "
             "textbook |", "|---|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        even = "does not fit" if r["even_step_s"] is None else f"{r['even_step_s'] * 1e3:.0f} ms"
        speedup = "-" if r["speedup"] is None else f"**{r['speedup']:.2f}x**"
        book = "-" if r["textbook_speedup"] is None else f"{r['textbook_speedup']:.2f}x"
        lines.append(f"| {r['cluster']} | {r['model']} | {r['schedule']} | {r['microbatches']} | "
                     f"{short(r['even_stage_layers'])} | {short(r['stage_layers'])} | {even} | "
                     f"{r['auto_step_s'] * 1e3:.0f} ms | {speedup} | {book} |")
    return "\n".join(lines)


def draw(rows: list[dict], png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [next(r for r in rows if r["cluster"] == name and r["schedule"] == "gpipe"
                   and r["microbatches"] == 4 * r["pipe"]) for name in PICTURED]
    fig, axes = plt.subplots(len(chosen), 3, figsize=(18, 4.2 * len(chosen)), squeeze=False)
    for (layers_ax, time_ax, memory_ax), r in zip(axes, chosen):
        P = r["pipe"]
        x = np.arange(P)
        slow = np.asarray(r["speeds"]) < 1
        for ax in (layers_ax, time_ax, memory_ax):
            for p in np.flatnonzero(slow):
                ax.axvspan(p - 0.5, p + 0.5, color="#eeeeee", zorder=0)
        w = 0.4
        pairs = ((layers_ax, r["even_stage_layers"], r["stage_layers"]),
                 (time_ax, np.asarray(r["even_stage_s"]) * 1e3, np.asarray(r["auto_stage_s"]) * 1e3),
                 (memory_ax, np.asarray(r["even_memory_bytes"]) / GIB, np.asarray(r["auto_memory_bytes"]) / GIB))
        for ax, even, auto in pairs:
            ax.bar(x - w / 2, even, w, label="even", color="#9e9e9e")
            ax.bar(x + w / 2, auto, w, label="auto", color="#1f77b4")
            ax.set_ylim(0, 1.22 * max(max(even), max(auto)))
        time_ax.axhline(max(pairs[1][1]), color="#616161", ls="--", lw=1, label="even's slowest")
        time_ax.axhline(max(pairs[1][2]), color="#1f77b4", ls="--", lw=1, label="auto's slowest")
        limits = r["memories_gib"]
        used = max(max(pairs[2][1]), max(pairs[2][2]))
        off_scale = min(limits) > 2 * used
        if not off_scale:
            memory_ax.step(np.arange(P + 1) - 0.5, [*limits, limits[-1]], where="post", color="#d62728", lw=1.2,
                           label="device memory")
            memory_ax.set_ylim(0, 1.22 * max(used, max(limits)))
        layers_ax.set_title(f"{r['cluster']}: layers per rank\n{r['model']}, {r['layers']} layers, "
                            f"GPipe, M={r['microbatches']}; shaded: speed 0.5", fontsize=10)
        even = "does not fit" if r["even_step_s"] is None else f"{r['even_step_s'] * 1e3:.0f} ms"
        time_ax.set_title(f"forward + backward per microbatch (the last rank's head included)\n"
                          f"step predicted: even {even}, auto {r['auto_step_s'] * 1e3:.0f} ms "
                          f"({r['speedup']:.2f}x)", fontsize=10)
        memory_ax.set_title("memory per device (stages padded to the largest)\n"
                            + (f"the {min(limits):g} GiB limit is off the scale" if off_scale
                               else "red: the device's memory"), fontsize=10)
        for ax, label in ((layers_ax, "layers"), (time_ax, "ms per microbatch"), (memory_ax, "GiB")):
            ax.set_xticks(x)
            ax.set_xticklabels([str(p) for p in x], fontsize=8)
            ax.set_xlabel("pipeline rank")
            ax.set_ylabel(label)
            ax.set_xlim(-0.6, P - 0.4)
            ax.legend(loc="upper left", fontsize=8, ncol=4)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "bench/results/hetero_allocation.json")
    parser.add_argument("--png", type=pathlib.Path, default=ROOT / "bench/figures/hetero_allocation.png")
    args = parser.parse_args()
    hw = hardware.load("h100", tempfile.mkdtemp())
    rows = run(hw)
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                                     "hardware": "h100", "rows": rows}, indent=1))
    draw(rows, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
