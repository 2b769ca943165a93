"""Job traces: the ``Job`` record the simulator runs, readers for Microsoft Philly's job
log and Alibaba PAI's gpu-v2020 job table, and a synthetic generator.

A trace gives each job an arrival, the devices it asked for and how long it ran; it does
not say what it trained. Each job is given a model from ``ZOO`` (seeded, uniform), and
its target is the work it did in the trace: ``duration * goodput(requested, base batch)``
samples at its base batch, so a job alone on its requested devices at its base batch
takes exactly its traced time (plus the simulator's restart cost).

Every reader error is one line (``TraceError``) naming the file, the job (its JSON index
or CSV line) and the field.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.inputs import InputError


class TraceError(InputError):
    """A trace that cannot be read, or a job the cluster cannot hold (one line)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of a trace."""

    id: str
    arrival_s: float  # since the trace's first arrival
    model: JobModel
    target: float  # samples at the model's base batch to finish
    requested_devices: int
    min_devices: int = 1
    max_devices: int | None = None  # None: the cluster
    restart_s: float = 30.0  # one resize's cost: checkpoint, restart, reload
    kind: str = ""  # the ZOO entry (or config name) the model came from

    @property
    def isolated_s(self) -> float:
        """Its time alone on its requested devices at its base batch (no restart)."""
        return self.target / self.model.goodput(self.requested_devices, self.model.base_batch)


# Illustrative job models, shaped after Pollux's workload table (Qiao et al., OSDI'21,
# table 1: image classification, language-model fine-tuning and training, speech); the
# step-time numbers are plausible, not measured, and the noise scales put each model's
# best batch inside its range. Real jobs bring a model fitted to their own steps.
ZOO: dict[str, JobModel] = {
    "resnet18-cifar10": JobModel(SpeedModel(0.010, 0.0004, 0.02), 128, 64, 4096, noise=2000.0),
    "resnet50-imagenet": JobModel(SpeedModel(0.020, 0.0040, 0.08), 256, 128, 8192, noise=5000.0),
    "bert-finetune": JobModel(SpeedModel(0.020, 0.0060, 0.15), 32, 16, 384, noise=300.0),
    "transformer-lm": JobModel(SpeedModel(0.030, 0.0100, 0.25), 64, 32, 1024, noise=1500.0),
    "deepspeech2": JobModel(SpeedModel(0.020, 0.0080, 0.20), 32, 16, 640, noise=800.0),
}


def job_from_duration(job_id: str, arrival_s: float, devices: int, duration_s: float, kind: str,
                      **kw) -> Job:
    """A ``Job`` whose target is ``duration_s`` of work on ``devices`` at the base batch."""
    model = ZOO[kind]
    target = duration_s * model.goodput(devices, model.base_batch)
    return Job(job_id, arrival_s, model, target, devices, kind=kind, **kw)


def check_fits(jobs: Sequence[Job], devices: int) -> None:
    """``TraceError`` for the first job that asks for more devices than the cluster has."""
    for job in jobs:
        need = max(job.requested_devices, job.min_devices)
        if need > devices:
            raise TraceError(f"job {job.id} asks for {need} devices; the cluster has {devices}")


# --- Philly ---------------------------------------------------------------------------

PHILLY_TIME = "%Y-%m-%d %H:%M:%S"


def read_philly(path: str | pathlib.Path, *, seed: int = 0, restart_s: float = 30.0) -> list[Job]:
    """Microsoft Philly's ``cluster_job_log`` (msr-fiddle/philly-traces; Jeon et al., ATC'19).

    A JSON list of jobs, each ``{"jobid", "submitted_time", "status", "attempts": [
    {"start_time", "end_time", "detail": [{"ip", "gpus": [...]}]}]}``, times as
    ``YYYY-MM-DD HH:MM:SS``. Choices: a job's devices are the most GPUs any attempt held;
    its duration is the sum of its attempts' run times (the gaps between retries were
    queueing, which the simulator models itself); every status is kept (a killed or
    failed job held its GPUs for that long too); a job that never ran (no attempt with
    both times, or no GPUs) is left out.
    """
    path = pathlib.Path(path)
    try:
        log = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not JSON ({e})") from None
    if not isinstance(log, list):
        raise TraceError(f"{path}: a Philly job log is a JSON list of jobs, not a {type(log).__name__}")
    rng = np.random.default_rng(seed)
    raw = []
    for i, entry in enumerate(log):
        where = f"{path}: job {i}"
        if not isinstance(entry, dict):
            raise TraceError(f"{where}: not a JSON object")
        for key in ("jobid", "submitted_time", "status", "attempts"):
            if key not in entry:
                raise TraceError(f"{where}: no '{key}' field")
        where = f"{where} ({entry['jobid']})"
        submitted = _philly_time(entry["submitted_time"], f"{where}: submitted_time")
        if submitted is None:
            raise TraceError(f"{where}: submitted_time is empty")
        devices, duration = 0, 0.0
        for k, attempt in enumerate(entry["attempts"] or []):
            for key in ("start_time", "end_time", "detail"):
                if key not in attempt:
                    raise TraceError(f"{where}: attempt {k} has no '{key}' field")
            start = _philly_time(attempt["start_time"], f"{where}: attempt {k} start_time")
            end = _philly_time(attempt["end_time"], f"{where}: attempt {k} end_time")
            gpus = 0
            for m, machine in enumerate(attempt["detail"] or []):
                if "gpus" not in machine:
                    raise TraceError(f"{where}: attempt {k} detail {m} has no 'gpus' field")
                gpus += len(machine["gpus"])
            if start is not None and end is not None and end > start:
                duration += (end - start).total_seconds()
                devices = max(devices, gpus)
        if devices and duration > 0:
            raw.append((submitted, str(entry["jobid"]), devices, duration))
    return _jobs(raw, rng, restart_s)


def _philly_time(value, where: str) -> datetime.datetime | None:
    if value in (None, "", "None"):
        return None
    try:
        return datetime.datetime.strptime(value, PHILLY_TIME)
    except (TypeError, ValueError):
        raise TraceError(f"{where} {value!r} is not YYYY-MM-DD HH:MM:SS") from None


def _jobs(raw, rng, restart_s) -> list[Job]:
    """``(submitted, id, devices, duration)`` rows as Jobs, arrivals from the first one."""
    if not raw:
        return []
    raw.sort(key=lambda r: (r[0], r[1]))
    first = raw[0][0]
    kinds = sorted(ZOO)
    jobs = []
    for submitted, job_id, devices, duration in raw:
        arrival = (submitted - first).total_seconds() if isinstance(first, datetime.datetime) else submitted - first
        kind = kinds[int(rng.integers(len(kinds)))]
        jobs.append(job_from_duration(job_id, float(arrival), devices, duration, kind, restart_s=restart_s))
    return jobs


# --- Alibaba PAI gpu-v2020 --------------------------------------------------------------

PAI_JOB_COLUMNS = ("job_name", "inst_id", "user", "status", "start_time", "end_time")
PAI_TASK_COLUMNS = ("job_name", "task_name", "inst_num", "status", "start_time", "end_time",
                    "plan_cpu", "plan_mem", "plan_gpu", "gpu_type")


def read_pai(path: str | pathlib.Path, *, task_table: str | pathlib.Path | None = None, seed: int = 0,
             restart_s: float = 30.0) -> list[Job]:
    """Alibaba PAI's ``pai_job_table.csv`` (alibaba/clusterdata, cluster-trace-gpu-v2020;
    Weng et al., NSDI'22).

    Columns ``job_name, inst_id, user, status, start_time, end_time`` (seconds; the job's
    submission and completion); the published files have no header row (it is in
    ``*.header``), so a first row that starts with ``job_name`` is read as a header and
    otherwise the published order is assumed. The job table has no GPU counts: they come
    from a ``plan_gpu`` column of the job table itself (a joined table), else from the
    task table (``task_table``, or ``pai_task_table.csv`` beside ``path``) as
    ``ceil(sum over the job's tasks of inst_num * plan_gpu / 100)`` (plan_gpu is in
    percent of a GPU). Choices: the duration is ``end_time - start_time``; jobs without an
    end (Running, Waiting) or without GPUs (CPU-only) are left out.
    """
    path = pathlib.Path(path)
    rows, columns = _csv_rows(path, PAI_JOB_COLUMNS)
    if "plan_gpu" in columns:
        gpus = None
    else:
        task_path = pathlib.Path(task_table) if task_table else path.with_name("pai_task_table.csv")
        if not task_path.exists():
            raise TraceError(f"{path}: no plan_gpu column and no task table {task_path} for the GPU counts")
        gpus = _pai_task_gpus(task_path)
    rng = np.random.default_rng(seed)
    raw = []
    for line, row in rows:
        where = f"{path}: line {line}"
        name = row["job_name"]
        start = _number(row, "start_time", where)
        if row["end_time"] in ("", None) or row["status"] in ("Running", "Waiting"):
            continue
        end = _number(row, "end_time", where)
        devices = (math.ceil(_number(row, "plan_gpu", where) / 100.0 - 1e-9) if gpus is None
                   else gpus.get(name, 0))
        if devices > 0 and end > start:
            raw.append((start, name, devices, end - start))
    return _jobs(raw, rng, restart_s)


def _pai_task_gpus(path: pathlib.Path) -> dict[str, int]:
    total: dict[str, float] = {}
    rows, _ = _csv_rows(path, PAI_TASK_COLUMNS, need=("job_name", "inst_num", "plan_gpu"))
    for line, row in rows:
        where = f"{path}: line {line}"
        if row["plan_gpu"] in ("", None):  # a task without GPUs
            continue
        share = _number(row, "inst_num", where) * _number(row, "plan_gpu", where) / 100.0
        total[row["job_name"]] = total.get(row["job_name"], 0.0) + share
    return {name: math.ceil(g - 1e-9) for name, g in total.items()}


def _csv_rows(path: pathlib.Path, published: tuple[str, ...], need: tuple[str, ...] | None = None):
    """``[(line number, {column: value})]`` and the columns; a header row if it has one."""
    need = need or published
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    if not lines:
        raise TraceError(f"{path}: empty")
    if lines[0] and lines[0][0].strip() == published[0]:
        columns = [c.strip() for c in lines[0]]
        missing = [c for c in need if c not in columns]
        if missing:
            raise TraceError(f"{path}: line 1: no column {', '.join(repr(c) for c in missing)} in the header")
        body, first = lines[1:], 2
    else:
        columns, body, first = list(published), lines, 1
    rows = []
    for n, values in enumerate(body, start=first):
        if not values:
            continue
        if len(values) < len(columns):
            raise TraceError(f"{path}: line {n}: no '{columns[len(values)]}' "
                             f"({len(values)} fields of {len(columns)})")
        rows.append((n, dict(zip(columns, values))))
    return rows, columns


def _number(row: dict, column: str, where: str) -> float:
    try:
        return float(row[column])
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {column} {row[column]!r} is not a number") from None


# --- synthetic ------------------------------------------------------------------------

# GPUs per job and durations as Gavel's Philly-derived generator draws them (Narayanan
# et al., OSDI'20, scheduler/utils.py, fitted to the Philly trace of Jeon et al.,
# ATC'19: most jobs take one GPU, a tenth take 8, and run times span minutes to days).
PHILLY_GPUS = {1: 0.83, 2: 0.03, 4: 0.03, 8: 0.10, 16: 0.01}
PHILLY_MINUTES = ((0.8, 1.5, 3.0), (0.2, 3.0, 4.0))  # (probability, log10 low, log10 high)


def synthetic(jobs: int, seed: int = 0, *, interarrival_s: float = 1800.0, max_devices: int | None = None,
              restart_s: float = 30.0) -> list[Job]:
    """``jobs`` jobs with Poisson arrivals (mean ``interarrival_s`` apart), Philly's GPU
    counts (capped at ``max_devices``, as Gavel caps them) and heavy-tailed durations:
    ``10 ** U(1.5, 3)`` minutes with probability 0.8, ``10 ** U(3, 4)`` (17 hours to a
    week) otherwise; mean about 17 hours, so 2 GPUs on average and a 30-minute mean gap
    keep about 66 GPUs busy. Deterministic for ``seed``.
    """
    rng = np.random.default_rng(seed)
    sizes, weights = zip(*PHILLY_GPUS.items())
    kinds = sorted(ZOO)
    arrival, out = 0.0, []
    for i in range(jobs):
        if i:
            arrival += float(rng.exponential(interarrival_s))
        devices = int(rng.choice(sizes, p=weights))
        if max_devices is not None:
            devices = min(devices, max_devices)
        _, lo, hi = PHILLY_MINUTES[0] if rng.random() < PHILLY_MINUTES[0][0] else PHILLY_MINUTES[1]
        minutes = 10 ** rng.uniform(lo, hi)
        kind = kinds[int(rng.integers(len(kinds)))]
        out.append(job_from_duration(f"job{i}", arrival, devices, 60.0 * minutes, kind, restart_s=restart_s))
    return out


def load(source: str, *, devices: int | None = None, seed: int = 0) -> list[Job]:
    """A trace by name: a Philly ``.json`` (or the published ``cluster_job_log``), a PAI
    ``.csv`` or ``synthetic:JOBS`` (GPU counts capped at ``devices``)."""
    if source.startswith("synthetic:"):
        count = source.removeprefix("synthetic:")
        if not count.isdigit() or int(count) < 1:
            raise TraceError(f"synthetic:{count}: JOBS must be a positive integer")
        return synthetic(int(count), seed, max_devices=devices)
    path = pathlib.Path(source)
    if not path.is_file():
        raise TraceError(f"{source}: no such file")
    if path.suffix == ".json" or path.name.startswith("cluster_job_log"):  # Philly's own file name
        return read_philly(path, seed=seed)
    if path.suffix == ".csv":
        return read_pai(path, seed=seed)
    raise TraceError(f"{source}: a trace is a Philly .json (or cluster_job_log), a PAI .csv or synthetic:JOBS")
