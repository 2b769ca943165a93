"""Elastic jobs on a local Ray instance: ``jaxpar-cluster run`` under FIFO and under
ONES, side by side, and every job's final loss against the same job run alone with the
same sequence of devices and batch sizes.

    python bench/cluster_ray.py [--devices 4] [--round-s 5] [--json PATH] [--png PATH]

Five ``tiny``-scale jobs (two layers, 64-token rows) arrive over 20 s on 4 declared
devices (each job's devices are simulated CPU devices of this machine, so the devices
share its 2 cores: JCTs here show the schedulers' decisions and the restarts they
cost, not a GPU cluster's speed). Each job's run is then replayed alone: one
``jaxpar-train`` invocation per segment the runner reported (its devices, batch and
the step it stopped at), in a fresh run dir, and its final loss compared with the
scheduled run's (``jaxpar-train``'s elastic resume is exact: the same losses).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
OVERRIDES = ["model.layers=2", "model.vocab_size=512", "data.max_files=120", "seq_len=64", "checkpoint.every=2",
             "eval.every=0", "optimizer.warmup_steps=5"]
JOBS = [  # id, steps, batch, requested devices, max devices, batch range, arrival (s)
    ("a", 120, 16, 2, 4, (8, 32), 0),
    ("b", 60, 16, 2, 4, (8, 32), 5),
    ("c", 60, 16, 4, 4, None, 10),
    ("d", 40, 16, 1, 2, (8, 32), 15),
    ("e", 40, 16, 1, 4, (8, 32), 20),
]


def jobs_yaml(path: pathlib.Path) -> None:
    jobs = []
    for job_id, steps, batch, devices, most, batches, arrival in JOBS:
        job = {"id": job_id, "config": "tiny", "overrides": OVERRIDES, "steps": steps, "batch_size": batch,
               "devices": devices, "min_devices": 1, "max_devices": most, "arrival_s": arrival}
        if batches:
            job["min_batch"], job["max_batch"] = batches
        jobs.append(job)
    path.write_text(yaml.safe_dump(jobs, sort_keys=False))


def schedule(jobs: pathlib.Path, scheduler: str, work: pathlib.Path, devices: int, round_s: float) -> list[dict]:
    command = pathlib.Path(sys.executable).parent / "jaxpar-cluster"
    out = subprocess.run([str(command), "run", str(jobs), "--scheduler", scheduler,
                          "--devices", str(devices), "--round-s", str(round_s), "--work-dir", str(work)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"cluster_ray: jaxpar-cluster run --scheduler {scheduler} failed:\n{out.stderr[-3000:]}")
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def alone(job: dict, run_dir: pathlib.Path, spec_steps: int, spec_batch: int) -> float:
    """The job replayed alone, as its resizes ran it: each segment (devices, batch) runs
    with the total steps the runner gave it (its samples target over the batch), then
    the checkpoints past the next segment's first step are dropped and the next segment
    resumes from that step. Checkpoints every step (kept) so every stop step has one."""
    import shutil

    segments, target, done = job["segments"], spec_steps * spec_batch, 0
    starts = [s[0] for s in segments[1:]] + [None]
    for (first, devices, batch), stop in zip(segments, starts):
        steps = first + -(-(target - done) // batch)  # the runner's: the samples left at this batch
        out = subprocess.run([sys.executable, "-m", "jaxpar.commands.train", "tiny", *OVERRIDES, f"run_dir={run_dir}",
                              f"batch_size={batch}", f"steps={steps}", "checkpoint.every=1", "checkpoint.keep=1000",
                              "--no-progress", f"--simulate-devices={devices}"],
                             capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices)))
        if out.returncode:
            raise SystemExit(f"cluster_ray: replaying job {job['id']} failed:\n{out.stderr[-3000:]}")
        if stop is not None:
            for later in [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit() and int(p.name) > stop]:
                shutil.rmtree(later)
            done += (stop - first) * batch
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    ids = [j[0] for j in JOBS]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        jct = {j["id"]: j["jct_s"] for j in results["runs"][name]["jobs"]}
        bars = ax.bar([i + k * width for i in range(len(ids))], [jct[i] for i in ids], width,
                      label=f"{name} (average {results['runs'][name]['avg_jct_s']:.0f} s)")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(ids))], [f"job {i}" for i in ids])
    ax.set_ylabel("JCT (s)")
    ax.set_title(f"jaxpar-cluster run on local Ray, {results['devices']} devices ({results['date']}, 2-core CPU)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--round-s", type=float, default=5.0)
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "bench/results/cluster_ray.json")
    parser.add_argument("--png", type=pathlib.Path, default=ROOT / "bench/figures/cluster_ray.png")
    args = parser.parse_args(argv)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "command": "python bench/cluster_ray.py " + " ".join(argv or sys.argv[1:]),
               "devices": args.devices, "round_s": args.round_s, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        jobs_yaml(tmp / "jobs.yaml")
        for scheduler in ("fifo", "ones"):
            jobs = schedule(tmp / "jobs.yaml", scheduler, tmp / scheduler, args.devices, args.round_s)
            for job in jobs:
                spec = next(j for j in JOBS if j[0] == job["id"])
                job["alone_loss"] = alone(job, tmp / f"{scheduler}-{job['id']}-alone", spec[1], spec[2])
                job["loss_rel_diff"] = abs(job["final_loss"] - job["alone_loss"]) / abs(job["alone_loss"])
            avg = sum(j["jct_s"] for j in jobs) / len(jobs)
            results["runs"][scheduler] = {"avg_jct_s": avg, "jobs": jobs}
            worst = max(j["loss_rel_diff"] for j in jobs)
            print(f"{scheduler}: average JCT {avg:.1f} s; resizes {sum(j['resizes'] for j in jobs)}; "
                  f"largest final-loss difference from the job alone {worst:.1e}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
