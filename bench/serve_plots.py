"""``bench/serve.py``'s pictures (matplotlib, Agg): p99 time to first token and median
time per output token against output tokens/s, a line per series (``draw``); the
chat-prefix load's time to first token as bars, prefix caching on against off
(``draw_prefix``); ``draw_all`` splits the rows between the two; ``series_label`` names
a row's series (legends and the printed table).
"""

from __future__ import annotations

import pathlib

from serve_servers import MODES


def series_label(row: dict) -> str:
    """The plain name of a row's series: ``jaxpar-serve, continuous batching``; another
    server by its ``--against-label`` and, when given, ``--against-mode``; then prefix
    caching (the chat load, or where it was off) and a cut KV pool."""
    mode, label = row.get("mode"), row["server"]
    if mode in MODES:
        label += f", {mode} batching"
    elif mode and mode != "its own":
        label += f", {mode}"
    if row.get("prefix_caching") is False:
        label += ", no prefix caching"
    elif row.get("prefix_caching") and row.get("load") == "chat-prefix":
        label += ", prefix caching"
    if row.get("kv_fraction"):
        label += f", KV pool at {row['kv_fraction']:.0%} of the load's"
    return label + row.get("series_note", "")


def title(meta: dict) -> str:
    """The picture's title from a run's ``meta``."""
    parts = [pathlib.Path(meta["model"]).name]
    if meta.get("requests"):
        parts.append(f"{meta['requests']} requests per rate")
    if meta.get("load") == "chat-prefix" and meta.get("system_prompt_tokens"):
        parts.append(f"a shared {meta['system_prompt_tokens']}-token system prompt")
    if meta.get("max_batch"):
        parts.append(f"{meta['max_batch']} slots")
    return ", ".join(parts + [meta["machine"], meta["date"]])


def draw(rows: list[dict], png: pathlib.Path, title: str) -> None:
    """p99 time to first token and median time per output token against output tokens/s:
    a line per series (colour and line style), a marker per offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    series = list(dict.fromkeys(series_label(r) for r in rows))
    rates = sorted({r["rate"] for r in rows})
    markers = dict(zip(rates, "osD^vP*X"))
    styles = ["-", "--", "-.", ":"]
    panels = ((axes[0], "ttft_p99_s", 1, "p99 time to first token, s (log scale; lower is better)",
               "waiting for the first token"),
              (axes[1], "tpot_p50_s", 1e3, "median time per output token, ms (lower is better)",
               "time per token once streaming"))
    for i, name in enumerate(series):
        mine = sorted((r for r in rows if series_label(r) == name), key=lambda r: r["rate"])
        x = [r["output_tokens_per_s"] for r in mine]
        for ax, key, scale, *_ in panels:
            y = [r[key] * scale for r in mine]
            ax.plot(x, y, color=f"C{i}", linestyle=styles[i % len(styles)], linewidth=1.6, zorder=2)
            for r, yi in zip(mine, y):
                ax.plot(r["output_tokens_per_s"], yi, marker=markers[r["rate"]], color=f"C{i}", markersize=8,
                        markeredgecolor="white", markeredgewidth=0.8, linestyle="none", zorder=3)
    for ax, _, _, label, what in panels:
        ax.set_xlabel("output tokens/s (higher is better \u2192)")
        ax.set_ylabel(label)
        ax.set_title(f"{what} (better: down and to the right \u2198)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[0].set_ylim(bottom=0.8 * min(r["ttft_p99_s"] for r in rows))  # a labelled tick below the lowest point
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    axes[1].set_ylim(bottom=0)
    lines = [Line2D([], [], color=f"C{i}", linestyle=styles[i % len(styles)], linewidth=1.6, label=name)
             for i, name in enumerate(series)]
    points = [Line2D([], [], color="0.4", marker=markers[rate], linestyle="none", markersize=8,
                     label=f"{rate:g} request{'s' if rate != 1 else ''}/s") for rate in rates]
    rows_below = -(-len(series) // 2)
    fig.legend(handles=lines, loc="lower center", ncol=2, fontsize=9, frameon=False, title="server, batching",
               title_fontsize=9, bbox_to_anchor=(0.5, 0.0))
    fig.legend(handles=points, loc="upper center", ncol=len(points), fontsize=9, frameon=False,
               title="offered load (marker)", title_fontsize=9, bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(title, fontsize=10)
    fig.set_figheight(5.4 + 0.16 * rows_below)
    fig.tight_layout(rect=(0, 0.04 + 0.04 * rows_below, 1, 0.86))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def draw_prefix(rows: list[dict], png: pathlib.Path, title: str) -> None:
    """The chat-prefix load: p50 and p99 time to first token per offered rate, a bar per
    series (prefix caching on and off, and any other server), each jaxpar pair's p50
    ratio (off over on) above its bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(series_label(r) for r in rows))
    rates = sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / len(series)
    for ax, key, what in ((axes[0], "ttft_p50_s", "median"), (axes[1], "ttft_p99_s", "p99")):
        top = 0.0
        for i, name in enumerate(series):
            by_rate = {r["rate"]: r for r in rows if series_label(r) == name}
            xs = [j + (i - (len(series) - 1) / 2) * width for j, rate in enumerate(rates) if rate in by_rate]
            ys = [by_rate[rate][key] for rate in rates if rate in by_rate]
            ax.bar(xs, ys, width, color=f"C{i}", label=name)
            top = max([top, *ys])
        if key == "ttft_p50_s":
            for j, rate in enumerate(rates):
                on = [r for r in rows if r["rate"] == rate and r.get("prefix_caching") is True]
                off = [r for r in rows if r["rate"] == rate and r.get("prefix_caching") is False]
                if len(on) == 1 and len(off) == 1 and on[0][key] > 0:
                    ax.annotate(f"off/on {off[0][key] / on[0][key]:.1f}x", (j, top * 1.02), ha="center", fontsize=8)
        ax.set_xticks(range(len(rates)), [f"{rate:g}/s" for rate in rates])
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"{what} time to first token, s (lower is better)")
        ax.set_ylim(top=top * 1.12 if top else None)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title("median; off / on above each rate", fontsize=10)
    axes[1].set_title("p99", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(series), 2), fontsize=9,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 + 0.045 * -(-len(series) // 2), 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def draw_all(rows: list[dict], metas: list[dict], png: pathlib.Path, prefix_png: pathlib.Path | None) -> list:
    """The chat-prefix rows as ``draw_prefix`` (to ``prefix_png``; to ``png`` where
    they are all the rows), the others as ``draw``: the paths written."""
    chat = [r for r in rows if r.get("load") == "chat-prefix"]
    other = [r for r in rows if r.get("load") != "chat-prefix"]
    meta = lambda load: next((m for m in metas if (m.get("load") == "chat-prefix") == load), metas[0])  # noqa: E731
    written = []
    if other:
        draw(other, png, title(meta(False)))
        written.append(png)
    if chat:
        path = prefix_png or (png.with_name(png.stem + "_chat_prefix" + png.suffix) if other else png)
        draw_prefix(chat, path, title(meta(True)))
        written.append(path)
    return written
