"""The embedding cache (``jaxpar.embedding``) measured: issue 37, item 5.

    python bench/embedding_cache.py hits [--steps 500] [--warmup-steps 500] [--seed 0]
        [--json PATH] [--png PATH]
    python bench/embedding_cache.py hits --smoke [--json PATH] [--png PATH]   # tiny: for the tests

Subcommands: ``hits`` (this file so far); ``throughput``, ``torchrec`` and ``memory``
are to come beside it.

The run kept in the repository (2 min 56 s wall, 174 s in the script, on 2 shared cores;
its results are deterministic for a seed):

    nice -n 10 python bench/embedding_cache.py hits --json bench/results/embedding_cache_hits.json \\
        --png bench/figures/embedding_cache_hits.png

``hits``: the hit rate of the cache, and the rows it moves, on FBGEMM
``generate_requests``-style id streams (``SyntheticData``: Zipf ids with exponent alpha
over a fixed random permutation of each table's rows, pooling 1, no reuse between
batches, so batches are independent draws).

* Streams: alpha 1.05 and 1.2, 10^6 and 10^7 rows in total, spread over 26 tables of
  equal size (as equal as integers allow: 38,461 or 38,462 rows each at 10^6), one
  concatenated id space and one cache for all of them, as ``jaxpar.embedding`` keeps it.
  Batch: 128 samples per 10^6 rows (128 at 10^6, 1,280 at 10^7), i.e. the largest power
  of two at 10^6 whose batches' unique ids (at most 3,037 of 3,328 lookups at alpha
  1.05 in the kept run) fit the 0.5% cache (5,000 rows), scaled with the table so that
  both sizes see the same batch-to-table ratio (at 10^7, at most 26,721 unique ids of
  33,280 lookups, 53% of the 0.5% cache's 50,000 rows). A batch that did not fit would
  stop the run with the cache's ValueError naming the smallest ratio that works.
* Steps: ``--warmup-steps`` batches (0 .. W-1) form the warm-up sample; the next
  ``--steps`` batches (W .. W+N-1) are the measured window. Every cache starts at the
  window's first batch; only "LFU + warm-up" has seen anything before it.
* Cache ratios 0.5%, 1%, 2%, 5% of the rows; policies:
    - ``lfu+warmup``: LFU, preloaded (``EmbeddingCache.warmup(sample_ids, ratio=1)``) with
      the cache's capacity of the hottest ids of the warm-up sample, the W batches
      *before* the measured window (a sample of the training stream, never the window;
      a different seed would not do: the seed fixes which ids are hot), whose counts
      also seed LFU's counts (Colossal-AI's dataset strategy);
    - ``lfu``: LFU starting empty; ``lru``: LRU starting empty;
    - ``oracle``: the static top-k: the ``cache_rows`` ids that occur in the most batches
      of the measured window itself (ties: the lower id), fixed, never evicted. Its hit
      count is the cache's, per batch the unique ids in the set; since a static set's hits
      are the sum of its ids' batch counts, this is the best any fixed set of that many
      rows can do on the window, with hindsight. Its misses are rows a step must fetch
      and write back (H2D = D2H = misses), and it evicts nothing.
  Also in the summary and the JSON, not the picture: ``static (sample)``, the top-k of
  the warm-up sample fixed for the window (the oracle without hindsight).
  Reading the oracle: with independent batches (no reuse, the independent reference
  model) no online policy reaches the best static set of the true distribution in
  expectation, and the oracle is fitted to the window's own draws, so it is above that
  too (hindsight); and both static sets count a miss as served without taking a slot,
  while the cache must admit every miss of a batch, evicting a resident row for each.
  The target is a high bar on this data by construction.
* Per run: the hit rate (hits / (hits + misses) over the window, unique ids per batch,
  as ``CacheStats`` counts), the same over the window's second half (after any cold
  start), per step; H2D and D2H bytes per step (mean) and evictions per step. The cache
  runs with dim 4 (hit rates and row counts do not depend on the dim; dim 4 keeps the
  10^7-row host table at 160 MB); bytes are reported for dim 128 with row-wise Adagrad:
  rows x (128 + 1) x 4 bytes, 516 bytes a row (warm-up preloads not included).
* A Criteo-format sample: no Criteo data is available offline, so the synthetic ids
  (alpha 1.05) over Criteo 1TB's 26 table sizes capped to 10^6 rows in all
  (``capped_rows``: 8 tables of ~110,000 rows, the rest uncapped, the smallest 3 rows),
  with the generator's labels and dense counts, are written as a Criteo TSV (label, 13
  integers, 26 hexadecimal categoricals, each ``id + rows * k`` for a random k, 8 hex
  digits) to a temporary directory, packed by ``pack_criteo`` and measured in file
  order the same way. It exercises the reader path (the packed ids are checked equal to
  the generated ones); it is synthetic data in Criteo's format, not Criteo's
  distribution.

Printed: a markdown table (alpha, rows, ratio, policy, hit rate, H2D MB/step, D2H
MB/step, evictions/step; MB = 10^6 bytes) and a summary of LFU + warm-up against the
oracle (the issue's target: at least the oracle's hit rate) at each point. The picture:
hit rate against cache ratio (log x), one line per policy, the oracle dashed, a panel
per stream; below, the hit rate per step at 1%.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLES = 26
RATIOS = (0.005, 0.01, 0.02, 0.05)
POLICIES = ("lfu+warmup", "lfu", "lru", "oracle")
LABELS = {"lfu+warmup": "LFU + warm-up", "lfu": "LFU, no warm-up", "lru": "LRU", "oracle": "static top-k oracle",
          "static-sample": "static (sample)"}
ALPHAS = (1.05, 1.2)
ROWS = (10**6, 10**7)
BATCH_PER_MILLION = 128  # samples per 10^6 rows: see the docstring
CACHE_DIM = 4  # what the cache runs with: hit rates do not depend on it
REPORT_DIM = 128  # what bytes are reported for
ROW_BYTES = (REPORT_DIM + 1) * 4  # a row and its row-wise Adagrad accumulator, float32
PER_STEP_RATIO = 0.01  # the ratio whose per-step hit rates are drawn
SMOKE = {"rows": (200_000,), "alphas": ALPHAS, "steps": 60, "warmup_steps": 40, "criteo_rows": 200_000}
MB = 1e6


def equal_tables(total: int, tables: int = TABLES) -> tuple[int, ...]:
    """``total`` rows over ``tables`` tables as equal as can be (the first ones one more)."""
    return tuple(total // tables + (1 if f < total % tables else 0) for f in range(tables))


def batch_for(total_rows: int) -> int:
    return max(1, round(BATCH_PER_MILLION * total_rows / 10**6))


# ------------------------------------------------------------------ the policies


def run_cache(warm: np.ndarray, window: np.ndarray, num_rows: int, ratio: float, policy: str) -> dict:
    """One cache over the window's batches (``window [N, B, F]`` global row ids), preloaded
    from ``warm [W, B, F]`` for ``lfu+warmup``: per-step hits, misses and evictions."""
    from jaxpar.embedding import EmbeddingCache, SparseOptimizer

    eviction = "lru" if policy == "lru" else "lfu"
    cache = EmbeddingCache.from_ratio(num_rows, CACHE_DIM, ratio, eviction=eviction,
                                      optimizer=SparseOptimizer("adagrad"),
                                      table=np.zeros((num_rows, CACHE_DIM), np.float32))
    loaded = cache.warmup(sample_ids=warm, ratio=1.0) if policy == "lfu+warmup" else 0
    hits, misses, evictions = (np.zeros(len(window), np.int64) for _ in range(3))
    for s, batch in enumerate(window):
        cache.prepare(batch)
        st = cache.last_step
        hits[s], misses[s], evictions[s] = st.hits, st.misses, st.evictions
        # the cache's own byte counts, at its dim: bytes follow rows one for one
        row = cache.store.row_bytes
        assert st.h2d_bytes == st.misses * row and st.d2h_bytes == st.evictions * row
    cache.close()
    return {"cache_rows": cache.cache_rows, "warmup_rows_loaded": loaded, "hits": hits, "misses": misses,
            "evictions": evictions}


def batch_uniques(batches: np.ndarray) -> list[np.ndarray]:
    return [np.unique(b) for b in batches]


def top_by_batches(batches: np.ndarray, num_rows: int) -> np.ndarray:
    """All ids ordered by the number of batches they occur in, most first (ties: lower
    id first); the first k are the static top-k cache of ``batches``."""
    presence = np.bincount(np.concatenate(batch_uniques(batches)), minlength=num_rows)
    return np.argsort(-presence, kind="stable")


def static_counts(uniques: list[np.ndarray], top: np.ndarray, num_rows: int) -> dict:
    """Per-step hits and misses of a fixed set ``top`` of ids, counted as the cache
    counts: per batch, its unique ids in the set (hits) and not (misses)."""
    member = np.zeros(num_rows, bool)
    member[top] = True
    hits = np.array([int(member[u].sum()) for u in uniques], np.int64)
    misses = np.array([len(u) for u in uniques], np.int64) - hits
    return {"cache_rows": len(top), "warmup_rows_loaded": 0, "hits": hits, "misses": misses,
            # a row outside the set is fetched for its step and written back after it
            "evictions": np.zeros(len(uniques), np.int64), "d2h_rows": misses}


def summarize(counts: dict, ratio: float, policy: str) -> dict:
    hits, misses, evictions = counts["hits"], counts["misses"], counts["evictions"]
    d2h_rows = counts.get("d2h_rows", evictions)
    half = len(hits) // 2
    rate = lambda h, m: float(h.sum() / max(1, h.sum() + m.sum()))  # noqa: E731
    per_step = hits / np.maximum(1, hits + misses)
    return {"ratio": ratio, "policy": policy, "cache_rows": counts["cache_rows"],
            "hit_rate": rate(hits, misses), "hit_rate_second_half": rate(hits[half:], misses[half:]),
            "hits": int(hits.sum()), "misses": int(misses.sum()),
            "h2d_bytes_per_step": float(misses.mean() * ROW_BYTES),
            "d2h_bytes_per_step": float(d2h_rows.mean() * ROW_BYTES),
            "evictions_per_step": float(evictions.mean()), "warmup_rows_loaded": counts["warmup_rows_loaded"],
            "per_step_hit_rate": [round(float(x), 4) for x in per_step]}


def measure(name: str, warm: np.ndarray, window: np.ndarray, num_rows: int, info: dict) -> dict:
    """Every ratio and policy on one stream; ``info`` describes it (goes in the JSON)."""
    from jaxpar.embedding import cache_rows_for

    t0 = time.perf_counter()
    uniques = batch_uniques(window)
    oracle_order = top_by_batches(window, num_rows)
    sample_order = top_by_batches(warm, num_rows)
    runs, side = [], []
    for ratio in RATIOS:
        cache_rows = cache_rows_for(num_rows, ratio)
        for policy in POLICIES:
            if policy == "oracle":
                counts = static_counts(uniques, oracle_order[:cache_rows], num_rows)
            else:
                counts = run_cache(warm, window, num_rows, ratio, policy)
                assert counts["cache_rows"] == cache_rows
            runs.append(summarize(counts, ratio, policy))
            print(f"  {name}: {ratio:.1%} {policy}: hit rate {runs[-1]['hit_rate']:.4f}", file=sys.stderr, flush=True)
        side.append(summarize(static_counts(uniques, sample_order[:cache_rows], num_rows), ratio, "static-sample"))
    sizes = [len(u) for u in uniques]
    return {"name": name, **info, "num_rows": num_rows, "batch": int(window.shape[1]),
            "warmup_steps": int(len(warm)), "steps": int(len(window)),
            "unique_ids_per_batch": {"mean": float(np.mean(sizes)), "max": int(max(sizes)),
                                     "lookups": int(window.shape[1] * window.shape[2])},
            "runs": runs, "static_sample": side, "seconds": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------ the streams


def zipf_stream(rows: tuple[int, ...], batch: int, alpha: float, seed: int, steps: int):
    from jaxpar.train.recsys_data import SyntheticData

    data = SyntheticData(rows, batch, alpha=alpha, seed=seed)
    return np.stack([data.ids(s, global_rows=True) for s in range(steps)]), data


def write_criteo_tsv(path: pathlib.Path, data, steps: int, seed: int) -> np.ndarray:
    """Steps 0..steps-1 of ``data`` (a ``SyntheticData``) as a Criteo TSV: label, 13
    integer counts, 26 hexadecimal categoricals; returns the per-feature ids [N, 26]."""
    rng = np.random.default_rng((seed, 37))
    rows = np.asarray(data.rows, np.int64)
    ids_all = []
    with open(path, "w") as f:
        for s in range(steps):
            b = data.batch(s)
            counts = np.rint(np.expm1(b["dense"].astype(np.float64))).astype(np.int64)  # the generator's log1p(count)
            ids = b["sparse"].astype(np.int64)
            hashed = ids + rows * rng.integers(0, 2**32 // rows, ids.shape)  # < 2^32, = id mod rows
            for label, dense, cats in zip(b["labels"], counts, hashed):
                f.write("\t".join([str(int(label)), *map(str, dense), *(f"{v:08x}" for v in cats)]) + "\n")
            ids_all.append(ids)
    return np.concatenate(ids_all)


def criteo_stream(total_rows: int, alpha: float, seed: int, steps: int) -> tuple[np.ndarray, dict]:
    """The Criteo-format sample: generated, written, packed, read back; global ids
    [steps, B, 26] in file order."""
    from jaxpar.models.dlrm import CRITEO_1TB_CARDINALITIES, capped_rows
    from jaxpar.train.recsys_data import SyntheticData, pack_criteo

    rows = capped_rows(CRITEO_1TB_CARDINALITIES, total_rows)
    batch = batch_for(total_rows)
    data = SyntheticData(rows, batch, alpha=alpha, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "criteo_format_sample.tsv"
        t0 = time.perf_counter()
        written = write_criteo_tsv(path, data, steps, seed)
        t1 = time.perf_counter()
        packed = pack_criteo(path, rows, cache_dir=tmp)
        sparse = np.array(packed.sparse, np.int64)
        t2 = time.perf_counter()
        size = path.stat().st_size
    if not np.array_equal(sparse, written):
        raise AssertionError("the packed Criteo-format sample's ids differ from the ones written")
    ids = (sparse + data.offsets).reshape(steps, batch, TABLES)
    return ids, {"table_rows": list(rows), "tsv_lines": int(len(sparse)), "tsv_bytes": int(size),
                 "write_s": round(t1 - t0, 1), "pack_s": round(t2 - t1, 1), "round_trip_exact": True}


def hits(args) -> None:
    began = time.perf_counter()
    rows_list, alphas, steps, warmup_steps = ROWS, ALPHAS, args.steps, args.warmup_steps
    criteo_rows = 10**6
    if args.smoke:
        rows_list, alphas, steps, warmup_steps = SMOKE["rows"], SMOKE["alphas"], SMOKE["steps"], SMOKE["warmup_steps"]
        criteo_rows = SMOKE["criteo_rows"]
    streams = []
    for total in rows_list:
        for alpha in alphas:
            rows, batch = equal_tables(total), batch_for(total)
            ids, _ = zipf_stream(rows, batch, alpha, args.seed, warmup_steps + steps)
            info = {"kind": "zipf", "alpha": alpha, "tables": TABLES, "table_rows": f"{TABLES} equal tables of "
                    f"{min(rows):,} to {max(rows):,} rows"}
            streams.append(measure(f"zipf alpha={alpha} rows={total:.0e}", ids[:warmup_steps], ids[warmup_steps:],
                                   total, info))
            del ids
    ids, info = criteo_stream(criteo_rows, 1.05, args.seed, warmup_steps + steps)
    info = {"kind": "criteo-format", "alpha": 1.05, "tables": TABLES, **info,
            "note": "synthetic Zipf ids written in Criteo's TSV format and read back through pack_criteo; "
                    "Criteo 1TB's table sizes capped to the total; not Criteo's distribution"}
    streams.append(measure(f"criteo-format rows={criteo_rows:.0e}", ids[:warmup_steps], ids[warmup_steps:],
                           criteo_rows, info))

    for line in table(streams):
        print(line)
    print()
    for line in target_table(streams):
        print(line)
    meta = {"command": " ".join(["python", *sys.argv]) if args.argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": importlib.metadata.version("jax"),
            "numpy": np.__version__, "git": git_head(), "seed": args.seed, "steps": steps,
            "warmup_steps": warmup_steps, "ratios": list(RATIOS), "policies": list(POLICIES),
            "cache_dim": CACHE_DIM, "report_dim": REPORT_DIM, "row_bytes": ROW_BYTES,
            "bytes": f"rows moved x ({REPORT_DIM} + 1 Adagrad accumulator) x 4 bytes; the cache ran at dim "
                     f"{CACHE_DIM}, hit rates and rows moved do not depend on the dim; warm-up preloads not counted",
            "hit_rate": "per batch, unique ids resident / unique ids (CacheStats); summed over the measured window",
            "warmup": f"lfu+warmup preloads the cache's capacity of the hottest ids of the {warmup_steps} batches "
                      "before the measured window (same stream); the other caches start empty at the window",
            "oracle": "the cache_rows ids in the most batches of the measured window, fixed; misses are fetched "
                      "and written back each step",
            "per_step_ratio": PER_STEP_RATIO, "seconds": round(time.perf_counter() - began, 1)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"meta": meta, "streams": streams}, indent=1)
        # per-step lists on one line each, not one number a line
        text = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(","))
                      + "]", text)
        args.json.write_text(text + "\n")
    if args.png:
        draw(streams, args.png, meta)
        print(f"wrote {args.png}", file=sys.stderr)
    print(f"done in {meta['seconds']} s", file=sys.stderr)


# ------------------------------------------------------------------ output


def stream_label(s: dict) -> tuple[str, str]:
    rows = f"10^{round(np.log10(s['num_rows']))}" if s["num_rows"] in (10**6, 10**7) else f"{s['num_rows']:,}"
    return (f"{s['alpha']:g}", rows if s["kind"] == "zipf" else f"{rows} (Criteo-format)")


def table(streams: list[dict]) -> list[str]:
    lines = ["| alpha | rows | ratio | policy | hit rate | H2D MB/step | D2H MB/step | evictions/step |",
             "|---|---|---|---|---|---|---|---|"]
    for s in streams:
        alpha, rows = stream_label(s)
        for r in s["runs"]:
            lines.append(f"| {alpha} | {rows} | {r['ratio']:.1%} | {LABELS[r['policy']]} | {r['hit_rate']:.3f} | "
                         f"{r['h2d_bytes_per_step'] / MB:.2f} | {r['d2h_bytes_per_step'] / MB:.2f} | "
                         f"{r['evictions_per_step']:,.0f} |")
    return lines


def target_table(streams: list[dict]) -> list[str]:
    """LFU + warm-up against the oracle (the issue's target) at every point."""
    lines = ["Target: LFU + warm-up >= the static top-k oracle (hit rate; second half of the window in brackets).", "",
             "| alpha | rows | ratio | oracle | LFU + warm-up | difference | met | static (sample) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in streams:
        alpha, rows = stream_label(s)
        by = {(r["ratio"], r["policy"]): r for r in s["runs"]}
        for side in s["static_sample"]:
            o, w = by[side["ratio"], "oracle"], by[side["ratio"], "lfu+warmup"]
            diff = w["hit_rate"] - o["hit_rate"]
            lines.append(f"| {alpha} | {rows} | {side['ratio']:.1%} | {o['hit_rate']:.3f} | {w['hit_rate']:.3f} "
                         f"({w['hit_rate_second_half']:.3f}) | {diff:+.3f} | {'yes' if diff >= 0 else 'no'} | "
                         f"{side['hit_rate']:.3f} |")
    return lines


def draw(streams: list[dict], png: pathlib.Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"lfu+warmup": "tab:blue", "lfu": "tab:orange", "lru": "tab:green", "oracle": "black"}
    n = len(streams)
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n, 8.4), squeeze=False, height_ratios=(3, 2))
    for k, s in enumerate(streams):
        ax, ax2 = axes[0, k], axes[1, k]
        for policy in POLICIES:
            runs = [r for r in s["runs"] if r["policy"] == policy]
            style = {"ls": "--", "lw": 1.6} if policy == "oracle" else {"ls": "-", "lw": 1.8}
            ax.plot([100 * r["ratio"] for r in runs], [r["hit_rate"] for r in runs], marker="o", ms=4,
                    color=colors[policy], label=LABELS[policy], **style)
            (run,) = [r for r in runs if r["ratio"] == PER_STEP_RATIO]
            ax2.plot(np.arange(1, len(run["per_step_hit_rate"]) + 1), run["per_step_hit_rate"], color=colors[policy],
                     lw=0.8 if policy != "oracle" else 1.0, ls="--" if policy == "oracle" else "-", alpha=0.85)
        ax.set_xscale("log")
        ax.set_xticks([100 * r for r in RATIOS], [f"{100 * r:g}%" for r in RATIOS])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        alpha, rows = stream_label(s)
        where = ("Criteo-format sample: synthetic ids,\nCriteo 1TB's table sizes capped" if s["kind"] != "zipf"
                 else f"Zipf stream, {TABLES} equal tables")
        ax.set_title(f"{where}\nalpha {alpha}, {rows.split(' ')[0]} rows, batch {s['batch']:,}", fontsize=10)
        ax.set_xlabel("cache ratio (rows cached / rows)")
        ax2.set_xlabel(f"measured step (cache {PER_STEP_RATIO:.0%})")
        ax2.grid(True, alpha=0.3)
        if k == 0:
            ax.set_ylabel("hit rate (unique ids per batch)")
            ax2.set_ylabel(f"hit rate per step, {PER_STEP_RATIO:.0%} cache")
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"jaxpar.embedding cache hit rates: {meta['warmup_steps']} warm-up batches, {meta['steps']} "
                 f"measured; oracle = the window's top-k ids, fixed; below: hit rate per step at "
                 f"{PER_STEP_RATIO:.0%}\n{meta['machine']}, JAX {meta['jax']}, {meta['date'][:10]}, git {meta['git']}",
                 fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return head.strip() + (" (uncommitted changes)" if dirty.strip() else "")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hits", help="hit rate and rows moved per step, by cache ratio and policy")
    p.add_argument("--steps", type=int, default=500, help="measured batches (500)")
    p.add_argument("--warmup-steps", type=int, default=500, help="batches before them: the warm-up sample (500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="2*10^5 rows, 40 + 60 steps: for the tests")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--png", type=pathlib.Path)
    p.set_defaults(run=hits)
    args = parser.parse_args(argv)
    args.argv = argv
    args.run(args)


if __name__ == "__main__":
    main()
