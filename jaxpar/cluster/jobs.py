"""``JOBS.yaml``, the job list ``jaxpar-cluster run`` runs: parsed and checked, one line per error.

A list of jobs, each a mapping::

    - id: a                      # unique
      config: tiny               # a shipped config name or a YAML path, as jaxpar-train takes
      overrides: [model.layers=2, seq_len=32]   # jaxpar-train key=value (default none)
      steps: 20                  # or samples: N (steps = ceil(N / batch))
      devices: 2                 # requested: what FIFO and SRTF give it
      min_devices: 1             # default 1
      max_devices: 4             # default: the cluster
      arrival_s: 0               # seconds after the run starts (default 0)

Optional: ``batch_size`` (default: the config's, which loading the config also checks
the overrides against), ``min_batch`` / ``max_batch`` (a batch range: the scheduler may
choose within it), ``restart_s`` (what one resize costs, the scheduler's estimate;
default 10), ``speed`` and ``noise`` (the gradient noise scale in samples). ``speed`` is
the scheduler's model of the job's step time before it has run: ``[alpha, beta, gamma]``
(``jaxpar.elastic.SpeedModel``'s seconds), or ``plan``, the cost model's prediction for
the job's config on ``--hardware`` (``job_speed``: data-parallel on 1,
2, 4, ... up to ``max_devices``, default 64, at its batches); default a guess of linear
speed-up, ``DEFAULT_SPEED``. Whichever it is, ``jaxpar-cluster run`` refits it to the
job's measured step times as the job runs (``SpeedModel.refit``). Errors name the file, the job's line and index and
the field: ``JOBS.yaml:7: job 1 (b): steps must be a positive integer, not 'x'``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib

from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.inputs import InputError, read_yaml

# A guess for a job that states no speed: a step's compute divides over its devices,
# with a small synchronisation cost, so a scheduler sees more devices as faster.
DEFAULT_SPEED = (0.01, 0.01, 0.005)


class JobsError(InputError):
    """A bad JOBS.yaml; its message is one line."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    id: str
    config: str
    overrides: tuple[str, ...]
    steps: int
    batch_size: int
    devices: int  # requested
    min_devices: int = 1
    max_devices: int | None = None
    arrival_s: float = 0.0
    min_batch: int | None = None
    max_batch: int | None = None
    restart_s: float = 10.0
    speed: tuple[float, float, float] = DEFAULT_SPEED
    noise: float | None = None
    adascale: bool = False  # its config's optimizer.batch_scaling=adascale: steps count progress

    @property
    def model(self) -> JobModel:
        return JobModel(SpeedModel(*self.speed), self.batch_size, self.min_batch, self.max_batch, self.noise)

    @property
    def target(self) -> float:
        """Samples to train (at the job's batch; with AdaScale, worth of them: its
        progress, the sum of the gains, counts steps at the job's batch)."""
        return float(self.steps * self.batch_size)


FIELDS = ("id", "config", "overrides", "steps", "samples", "batch_size", "devices", "min_devices",
          "max_devices", "arrival_s", "min_batch", "max_batch", "restart_s", "speed", "noise")


def load_jobs(path: str | pathlib.Path, hardware: str | None = None) -> list[JobSpec]:
    """The jobs of ``path``; ``JobsError`` with one line for the first thing wrong.
    ``hardware``: the profile ``speed: plan`` predicts for (None: the present device's)."""
    path = pathlib.Path(path)
    data, root = read_yaml(path, error=JobsError, nodes=True)
    if not isinstance(data, list) or not data:
        raise JobsError(f"{path}: expected a non-empty list of jobs")
    jobs, seen = [], set()
    for index, (entry, node) in enumerate(zip(data, root.value)):
        where = f"{path}:{node.start_mark.line + 1}: job {index}"
        job = _job(entry, where, hardware)
        if job.id in seen:
            raise JobsError(f"{where}: id {job.id!r} is used twice")
        seen.add(job.id)
        jobs.append(job)
    return jobs


def _job(entry, where: str, hardware: str | None = None) -> JobSpec:
    if not isinstance(entry, dict):
        raise JobsError(f"{where}: expected a mapping of fields, not {entry!r}")
    if "id" in entry:
        where = f"{where} ({entry['id']})"
    for key in entry:
        if key not in FIELDS:
            near = difflib.get_close_matches(str(key), FIELDS, n=1)
            raise JobsError(f"{where}: unknown field {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    for key in ("id", "config", "devices"):
        if key not in entry:
            raise JobsError(f"{where}: {key} is required")
    if ("steps" in entry) == ("samples" in entry):
        raise JobsError(f"{where}: give exactly one of steps and samples")

    def positive(key, kind=int, default=None):
        value = entry.get(key, default)
        if value is None:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        if not ok or (kind is int and value != int(value)):
            what = "integer" if kind is int else "number"
            raise JobsError(f"{where}: {key} must be a positive {what}, not {value!r}")
        return kind(value)

    overrides = entry.get("overrides", [])
    if not isinstance(overrides, list) or any(not isinstance(o, str) or "=" not in o for o in overrides):
        raise JobsError(f"{where}: overrides must be a list of key=value strings, not {overrides!r}")
    cfg = _config(entry["config"], overrides, where)
    batch = positive("batch_size") or cfg.batch_size
    steps = positive("steps") or math.ceil(positive("samples") / batch)
    speed = entry.get("speed", DEFAULT_SPEED)
    if speed == "plan":
        speed = _planned(entry, overrides, batch, positive, where, hardware)
    if not (isinstance(speed, (list, tuple)) and len(speed) == 3
            and all(isinstance(s, (int, float)) and s >= 0 for s in speed)):
        raise JobsError(f"{where}: speed must be plan or [alpha, beta, gamma], three non-negative seconds, "
                        f"not {speed!r}")
    arrival = entry.get("arrival_s", 0)
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or arrival < 0:
        raise JobsError(f"{where}: arrival_s must be a non-negative number, not {arrival!r}")
    job = JobSpec(
        id=str(entry["id"]), config=str(entry["config"]), overrides=tuple(overrides), steps=steps,
        batch_size=batch, devices=positive("devices"), min_devices=positive("min_devices", default=1),
        max_devices=positive("max_devices"), arrival_s=float(arrival), min_batch=positive("min_batch"),
        max_batch=positive("max_batch"), restart_s=positive("restart_s", float, 10.0),
        speed=tuple(float(s) for s in speed), noise=positive("noise", float),
        adascale=cfg.optimizer.batch_scaling == "adascale")
    if not job.min_devices <= job.devices <= (job.max_devices or job.devices):
        raise JobsError(f"{where}: devices={job.devices} must lie in [min_devices={job.min_devices}, "
                        f"max_devices={job.max_devices}]")
    try:
        job.model
    except ValueError as e:
        raise JobsError(f"{where}: {e}") from None
    return job


def _config(config: str, overrides: list[str], where: str):
    """``config`` with ``overrides`` (loading it checks them): its batch size and
    ``optimizer.batch_scaling`` are the job's defaults."""
    from jaxpar.train.config import ConfigError, load_config  # start-up: as _planned's

    try:
        return load_config(config, list(overrides))
    except ConfigError as e:
        raise JobsError(f"{where}: {e}") from None


def _planned(entry, overrides: list[str], batch: int, positive, where: str, hardware: str | None) -> tuple:
    """``speed: plan``: ``job_speed``'s three numbers for the job."""
    # Here, not at the top: a config and the planner load flax, optax and orbax (0.8 s of
    # jaxpar-cluster's start), which only a JOBS.yaml with speed: plan needs.
    from jaxpar.train import plan
    from jaxpar.train.config import ConfigError, load_config
    from jaxpar.train.data import cache_dir_of

    lo, hi = positive("min_batch") or batch, positive("max_batch") or batch
    batches = {lo, batch, hi} | {2**k for k in range(hi.bit_length()) if lo <= 2**k <= hi}
    try:
        cfg = load_config(entry["config"], [*overrides, f"batch_size={batch}"])
        hw = plan.hardware_for(hardware, cache_dir_of(cfg.cache_dir))
        model = job_speed(cfg, hw, positive("max_devices") or 64, batches)
    except ConfigError as e:
        raise JobsError(f"{where}: speed: plan: {e}") from None
    return (model.alpha, model.beta, model.gamma)


def job_speed(cfg, hw, devices: int, batches) -> SpeedModel:
    """A job's ``jaxpar.elastic.SpeedModel`` from the cost model: the predicted step time
    of ``cfg``'s model (a ``jaxpar.train.config.Config``) on ``hw`` (a
    ``jaxpar.planning.hardware.Hardware``), data-parallel on 1, 2, 4, ... up to
    ``devices`` devices (one node each), at each of ``batches`` that the device count
    divides, fitted by least squares (what JOBS.yaml's ``speed: plan`` gives
    ``jaxpar-cluster``); ``ConfigError`` where no point can be predicted. (The
    cluster's, not the trainer's: no run calls it.)"""
    # Here, as _planned's imports: only ``speed: plan`` needs the planner and a config
    # (0.5 s of jaxpar-cluster's start, which jaxpar-cluster simulate never uses).
    from jaxpar.planning import cost
    from jaxpar.layout import Layout
    from jaxpar.planning.workload import Workload
    from jaxpar.train.config import ConfigError

    points, d = [], 1
    while d <= devices:
        for batch in sorted(set(batches)):
            if batch % d:
                continue
            layout = Layout(data=d, remat=cfg.layout.remat)
            try:
                t = cost.step_time(Workload(cfg.model, batch, cfg.seq_len), layout, hw, devices_per_node=d).total
            except ValueError:  # a layout the shapes cannot take
                continue
            points.append((d, batch, t))
        d *= 2
    if not points:
        raise ConfigError(f"no data-parallel layout of batches {sorted(set(batches))} on up to {devices} devices "
                          "for the cost model to predict")
    return SpeedModel.fit(points)
