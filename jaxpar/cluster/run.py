"""A scheduler's decisions carried out on Ray (issue 40, item 5): what ``jaxpar-cluster
run JOBS.yaml --scheduler NAME [--address ADDR]`` runs (its command line:
``jaxpar.commands.cluster``).

Ray's core API only (no dashboard, no job API). Locally (no ``--address``) ``ray.init``
starts a Ray instance on this machine whose ``--devices N`` devices are a declared
resource, ``{"device": N}``; a job on ``d`` devices is one ``jaxpar-train`` process on
``d`` simulated CPU devices (``--simulate-devices d``, ``JAX_NUM_CPU_DEVICES=d``; the
config's ``mesh.data``, when unset, takes them), its ``run_dir`` under ``--work-dir``.

* A job's devices are held by a placement group, created before the job starts and
  removed when it stops, so the devices the scheduler gave it are the job's alone
  while it runs: one bundle ``{"device": d}`` (a job is one process, so one node), which
  the job's actor takes whole. (``d`` bundles of one device each would leave the actor
  able to claim only one of them, and on GPUs Ray would then show the process one GPU:
  Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPUs an actor holds.)
* The process runs under a ``JobProcess`` actor scheduled in that placement group: the
  actor starts ``jaxpar-train``, reports its exit, and stops it on request (SIGTERM,
  which ``jaxpar-train`` answers at the next step boundary by saving that step and
  exiting 143). The child dies with the actor (``PR_SET_PDEATHSIG``), so a killed
  actor or Ray instance leaves no training process behind.
* Every ``--round-s`` seconds, and whenever a job finishes, the loop builds a
  ``JobView`` of every job that has arrived and not finished (progress: the samples
  its ``metrics.jsonl`` steps trained, at each segment's batch), asks the scheduler,
  checks its decision (``jaxpar.elastic.scheduler.check``) and carries it out: a job
  whose devices (or, for a job with a batch range, batch) change is stopped (SIGTERM),
  its placement group removed, and started again on its new devices, resuming from the
  step it saved; a job given 0 devices waits.
* A job's target is samples (``steps`` times its batch): restarted at another batch
  (``jaxpar-train``'s elastic resume, ``batch_size=``), its ``steps`` becomes the steps
  done plus the remaining samples over the new batch, rounded up. The learning-rate
  schedule stays on ``jaxpar-train``'s step clock over the new ``steps``, and
  ``optimizer.batch_scaling`` (the job's overrides) scales its peak. A job whose config
  says ``optimizer.batch_scaling=adascale`` counts progress as ``jaxpar-train`` does, in
  AdaScale's gains (``jaxpar.train.stepping.finished``): its base batch is the job's
  (``optimizer.base_batch_size``), its ``steps`` stay the job's at any batch (the run
  ends when the sum of its gains reaches them), and its progress is that sum logged in
  ``metrics.jsonl`` times the base batch. A job without a batch range keeps its batch
  whatever the decision says.

On a Ray cluster of GPU nodes (``--address ray://head:10001 --resource GPU``) the same
loop runs: the bundle is ``{"GPU": d}`` and the actor holds it as ``num_gpus=d``, so
``jaxpar-train`` sees exactly its GPUs (``--simulate-devices`` is ignored on GPUs). The
nodes need jaxpar installed and ``--work-dir`` on shared storage (a resized job resumes
from its checkpoints there, perhaps on another node).

A job given more devices than a node holds (``--devices-per-node K``; default the
largest node's count of the resource) runs as ``n`` processes of ``d / n`` devices each
(``processes_for``: the fewest of equal size that fit a node), one bundle and one actor
each, placed ``PACK``; they join JAX's distributed runtime through
``JAXPAR_COORDINATOR`` (a free port on bundle 0's node), ``JAXPAR_NUM_PROCESSES`` and
``JAXPAR_PROCESS_ID`` (``jaxpar.placement.runtime.initialize_distributed``; gloo on
CPU). A stop signals every process (they agree on the step to stop at); the job's exit
status is ``combined_status``'s. Locally, ``--devices-per-node`` below ``--devices``
simulates nodes that way.

On leaving, however it leaves (done, an error, Ctrl-C), every training process is
stopped, every placement group removed and Ray shut down.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from jaxpar.cluster.jobs import JobSpec
from jaxpar.elastic.baselines import by_name
from jaxpar.elastic.jobs import JobModel
from jaxpar.elastic.scheduler import Allocation, JobView, Scheduler, check

CONNECT_TIMEOUT_S = 10.0
STOP_GRACE_S = 60.0  # SIGTERM, then SIGKILL: a step and its save on a loaded machine
# How long a poll waits for a job's actors to answer before the job counts as lost: an actor
# answers once its process is up, and on a loaded 2-core machine (load 10) starting one
# took over 60 s (2026-11-29).
POLL_TIMEOUT_S = 300


class RunError(RuntimeError):
    """The run cannot go on; its message is one line."""


# The process on the cluster -------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class JobProcess:
    """One ``jaxpar-train`` process (a Ray actor: ``_actor()``). The process is started by
    a thread that lives until it exits, so ``PR_SET_PDEATHSIG`` ties it to this actor."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str):
        self._rc: int | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(argv, env, log), daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self, argv, env, log):
        with open(log, "a") as out:
            try:
                self._proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            except OSError as e:  # reported as the exit status of a command not found
                print(f"cannot start {argv[0]}: {e}", file=out)
                self._proc, self._rc = None, 127
                return
            finally:
                self._started.set()
            self._rc = self._proc.wait()

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        return self._rc

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM (the step saved, exit 143), SIGKILL after ``grace_s``; the exit status."""
        if self._rc is None:
            self._proc.send_signal(signal.SIGTERM)
            self._thread.join(grace_s)
            if self._rc is None:
                self._proc.kill()
                self._thread.join()
        return self._rc


def _actor():
    import ray

    return ray.remote(num_cpus=0, max_concurrency=1)(JobProcess)


# One job's state on the driver -------------------------------------------------------------


@dataclasses.dataclass
class Running:
    spec: JobSpec
    run_dir: pathlib.Path
    devices: int = 0  # now (0: waiting)
    group: object = None  # its placement group
    processes: list = dataclasses.field(default_factory=list)  # its JobProcess actors, one per bundle
    segments: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (first step, devices, batch)
    resizes: int = 0
    attained_s: float = 0.0  # device-seconds
    since_s: float = 0.0  # when it last started
    finished_s: float | None = None

    def steps_done(self) -> int:
        return len(metrics(self.run_dir))

    @property
    def batch(self) -> int:
        return self.segments[-1][2] if self.segments else self.spec.batch_size

    def samples_done(self, steps: int | None = None) -> float:
        """Samples trained in the first ``steps`` steps (default: all logged), by segment;
        for an AdaScale job, what they are worth: its logged progress (the sum of the
        gains, ``jaxpar.train.stepping.finished``'s) in steps at the job's batch."""
        steps = self.steps_done() if steps is None else steps
        if self.spec.adascale:
            records = metrics(self.run_dir)[:steps]
            return records[-1]["adascale_progress"] * self.spec.batch_size if records else 0.0
        bounds = [first for first, _, _ in self.segments[1:]] + [steps]
        return sum(max(min(end, steps) - first, 0) * batch
                   for (first, _, batch), end in zip(self.segments, bounds))

    def next_batch(self, allocation: Allocation) -> int:
        """The batch to run at: the decision's where the job has a batch range."""
        lo, hi = self.spec.model.batch_range
        return allocation.batch if lo < hi else self.batch

    def measured(self, records: list[dict]) -> list[tuple[int, int, float]]:
        """``(devices, batch, step seconds)`` of each segment that has run past its first
        step (which compiles): the median of its other steps' ``step_time_s``."""
        bounds = [first for first, _, _ in self.segments[1:]] + [len(records)]
        points = []
        for (first, devices, batch), end in zip(self.segments, bounds):
            times = [r["step_time_s"] for r in records[first + 1:end] if "step_time_s" in r]
            if times:
                points.append((devices, batch, float(np.median(times))))
        return points

    def model(self, records: list[dict]) -> JobModel:
        """The job's model as the scheduler sees it now: JOBS.yaml's refitted to the
        step times measured so far (``SpeedModel.refit``), and, for a job with a batch
        range that logs ``noise_scale`` (``eval.noise_scale=true``), its latest value."""
        spec = self.spec
        noise = spec.noise
        lo, hi = spec.model.batch_range
        logged = [r["noise_scale"] for r in records if math.isfinite(r.get("noise_scale", math.nan))]
        if lo < hi and logged and logged[-1] > 0:
            noise = float(logged[-1])
        return dataclasses.replace(spec.model, speed=spec.model.speed.refit(self.measured(records)), noise=noise)

    def view(self, now_s: float) -> JobView:
        spec = self.spec
        attained = self.attained_s + (now_s - self.since_s) * self.devices
        records = metrics(self.run_dir)
        return JobView(id=spec.id, arrival_s=spec.arrival_s, model=self.model(records), target=spec.target,
                       progress=float(self.samples_done(len(records))), requested_devices=spec.devices,
                       min_devices=spec.min_devices, max_devices=spec.max_devices, devices=self.devices,
                       batch=self.batch if self.segments else None, attained_service_s=attained,
                       restart_s=spec.restart_s)


def metrics(run_dir: pathlib.Path) -> list[dict]:
    """The run's ``metrics.jsonl`` records (a line being written is left out)."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def train_command(spec: JobSpec, run_dir: pathlib.Path, devices: int, batch: int | None = None,
                  steps: int | None = None) -> tuple[list[str], dict[str, str]]:
    """``jaxpar-train``'s arguments and environment for ``spec`` on ``devices`` devices,
    at ``batch`` for ``steps`` in all (default: the job's)."""
    argv = [sys.executable, "-m", "jaxpar.commands.train", spec.config, *spec.overrides, f"run_dir={run_dir}",
            f"steps={steps or spec.steps}", f"batch_size={batch or spec.batch_size}",
            *([f"optimizer.base_batch_size={spec.batch_size}"] if spec.adascale else []),
            "--simulate-devices", str(devices), "--no-progress"]
    return argv, {"JAX_NUM_CPU_DEVICES": str(devices)}


# The loop --------------------------------------------------------------------------------


def processes_for(devices: int, per_node: int) -> tuple[int, int]:
    """``(processes, devices each)`` for a job on ``devices`` devices on nodes of
    ``per_node``: one process where it fits a node, else the fewest processes of equal
    size (JAX's multi-process meshes need the same count in each) that each fit one."""
    if devices <= per_node:
        return 1, devices
    n = next(n for n in range(math.ceil(devices / per_node), devices + 1) if devices % n == 0)
    return n, devices // n


def combined_status(statuses: list[int | None]) -> int | None:
    """A job's exit status from its processes': the first that is neither 0 nor one it
    resumes from (a failure), else None while any runs, else 0 if all finished, else the
    first non-zero (stopped: it resumes)."""
    failed = [rc for rc in statuses if rc is not None and rc != 0 and not resumable(rc)]
    if failed:
        return failed[0]
    if any(rc is None for rc in statuses):
        return None
    return next((rc for rc in statuses if rc != 0), 0)


def _free_address() -> str:
    """``host:port`` on this node with a port free now: process 0's coordinator."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


class Cluster:
    """Starts and stops jobs on Ray; ``close()`` leaves nothing running. ``per_node``:
    the devices one process (one node) holds; a job on more is several processes."""

    def __init__(self, resource: str, per_node: int):
        self.resource, self.per_node = resource, per_node
        self.live: list[Running] = []

    def start(self, job: Running, devices: int, batch: int, now_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n, per = processes_for(devices, self.per_node)
        group = placement_group([{self.resource: per}] * n, strategy="STRICT_PACK" if n == 1 else "PACK")
        try:
            ray.get(group.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"job {job.spec.id}: {devices} {self.resource} not free within 120 s") from None
        job.group, job.devices, job.since_s = group, devices, now_s
        self.live.append(job)
        done = job.steps_done()
        # an AdaScale run ends by its progress, whatever its batch: the job's steps as they are
        steps = job.spec.steps if job.spec.adascale else done + math.ceil((job.spec.target - job.samples_done(done))
                                                                          / batch)
        job.segments.append((done, devices, batch))
        argv, env = train_command(job.spec, job.run_dir, per, batch, steps)
        job.run_dir.mkdir(parents=True, exist_ok=True)

        def in_bundle(i):
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)

        if n > 1:  # JAX's distributed runtime (jaxpar.placement.runtime.initialize_distributed)
            coordinator = ray.get(ray.remote(num_cpus=0)(_free_address).options(
                scheduling_strategy=in_bundle(0)).remote())
            env = {**env, "JAXPAR_COORDINATOR": coordinator, "JAXPAR_NUM_PROCESSES": str(n)}
        holds = {"num_gpus": per} if self.resource == "GPU" else {"resources": {self.resource: per}}
        log = job.run_dir.parent / job.spec.id
        job.processes = [
            _actor().options(scheduling_strategy=in_bundle(i), **holds).remote(
                argv, {**env, "JAXPAR_PROCESS_ID": str(i)} if n > 1 else env,
                f"{log}.log" if i == 0 else f"{log}.{i}.log")
            for i in range(n)]

    def stop(self, job: Running, now_s: float) -> int | None:
        """Stops ``job`` (SIGTERM to each process) and frees its devices; its exit status
        (``combined_status``; None where its actors are gone)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        statuses = []
        if job.processes:
            try:
                statuses = ray.get([p.stop.remote() for p in job.processes], timeout=STOP_GRACE_S + 30)
            except Exception:  # noqa: BLE001  an actor is gone: its child went with it
                statuses = [None]
            for p in job.processes:
                ray.kill(p)
        if job.group is not None:
            remove_placement_group(job.group)
        job.attained_s += (now_s - job.since_s) * job.devices
        job.processes, job.group, job.devices = [], None, 0
        if job in self.live:
            self.live.remove(job)
        return combined_status(statuses) if None not in statuses else None

    def poll(self, job: Running) -> int | None:
        import ray

        try:
            return combined_status(ray.get([p.poll.remote() for p in job.processes], timeout=POLL_TIMEOUT_S))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise RunError(f"job {job.spec.id}: lost its process ({type(e).__name__})") from None

    def close(self) -> None:
        for job in list(self.live):
            self.stop(job, job.since_s)


def run_jobs(jobs: list[JobSpec], scheduler: Scheduler, *, devices: int, work_dir: pathlib.Path,
             round_s: float = 5.0, resource: str = "device", per_node: int | None = None,
             clock=time.monotonic) -> list[dict]:
    """Runs ``jobs`` under ``scheduler`` on the Ray instance this process is connected
    to; a summary per job (``id``, ``jct_s``, ``resizes``, ``segments``: (first step,
    devices, batch) of each start, ``final_loss``). Raises ``RunError`` when a job fails,
    asks for more devices than the cluster has, or the scheduler leaves the cluster idle
    with jobs waiting and none to come (it would wait for ever). ``per_node``: the devices
    of one node (None: all of them, one node); a job given more runs as several processes."""
    for spec in jobs:
        if spec.devices > devices:
            raise RunError(f"job {spec.id} asks for {spec.devices} devices; the cluster has {devices}")
    cluster = Cluster(resource, per_node or devices)
    state = {s.id: Running(s, pathlib.Path(work_dir) / s.id) for s in jobs}
    t0 = clock()
    try:
        while any(j.finished_s is None for j in state.values()):
            now = clock() - t0
            active = [j for j in state.values() if j.finished_s is None and j.spec.arrival_s <= now]
            views = [j.view(now) for j in active]
            decision = dict(scheduler.decide(now, views, devices)) if views else {}
            check(decision, views, devices)
            _carry_out(cluster, active, decision, now)
            waiting = [j.spec.id for j in active if j.finished_s is None]
            if waiting and not cluster.live and all(j.spec.arrival_s <= now for j in state.values()):
                raise RunError(f"scheduler {getattr(scheduler, 'name', scheduler)!r} runs none of the waiting "
                               f"jobs {waiting} on {devices} free devices")
            _wait_round(cluster, state, t0, clock, round_s)
    finally:
        cluster.close()
    return [_summary(j) for j in state.values()]


def resumable(rc: int | None) -> bool:
    """Whether a job stopped for a resize with exit status ``rc`` resumes from its newest
    checkpoint: 143, stopped at a step boundary with that step saved; -SIGTERM, stopped
    before its loop began (loading, compiling: Python's default handler); -SIGKILL, past
    the grace period; None, its actor already gone. Nothing it saved is lost in any."""
    return rc in (128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL, None)


def _carry_out(cluster: Cluster, active: list[Running], decision: dict[str, Allocation], now: float) -> None:
    """Stops the jobs whose devices or batch change (freeing their devices first), then
    starts those given devices."""
    wait = Allocation(0, 0)
    for job in active:
        new = decision.get(job.spec.id, wait)
        if job.devices and (new.devices != job.devices or (new.devices and job.next_batch(new) != job.batch)):
            rc = cluster.stop(job, now)
            if rc == 0:  # it finished before the signal
                job.finished_s = now
            elif not resumable(rc):
                raise RunError(f"job {job.spec.id}: jaxpar-train exited {rc} when stopped; see "
                               f"{job.run_dir.parent / (job.spec.id + '.log')}")
            elif new.devices:
                job.resizes += 1
    for job in active:
        new = decision.get(job.spec.id, wait)
        if job.finished_s is None and new.devices and not job.devices:
            cluster.start(job, new.devices, job.next_batch(new), now)


def _wait_round(cluster: Cluster, state: dict[str, Running], t0: float, clock, round_s: float) -> None:
    """Until ``round_s`` passes, a job finishes or one arrives."""
    end = clock() + round_s
    arrivals = [t0 + j.spec.arrival_s for j in state.values() if j.spec.arrival_s > clock() - t0]
    while clock() < min([end, *arrivals]):
        for job in list(cluster.live):
            rc = cluster.poll(job)
            if rc is None:
                continue
            now = clock() - t0
            cluster.stop(job, now)
            if rc != 0:
                raise RunError(f"job {job.spec.id}: jaxpar-train exited {rc}; see "
                               f"{job.run_dir.parent / (job.spec.id + '.log')}")
            job.finished_s = now
            return
        time.sleep(0.2)


def _summary(job: Running) -> dict:
    records = metrics(job.run_dir)
    return {"id": job.spec.id, "jct_s": round(job.finished_s - job.spec.arrival_s, 3), "resizes": job.resizes,
            "segments": job.segments, "final_loss": records[-1]["loss"] if records else None}


# Connecting ---------------------------------------------------------------------------------


def connect(address: str | None, devices: int | None, resource: str, timeout_s: float = CONNECT_TIMEOUT_S) -> int:
    """``ray.init``: a local instance with ``devices`` declared devices, or the cluster at
    ``address`` (its total of ``resource``, or ``devices`` of them); the device count.
    An address whose port does not answer within ``timeout_s`` (a TCP connect first:
    ``ray.init`` itself retries for much longer): ``RunError``."""
    import ray

    if address is None:
        ray.init(resources={resource: devices or 4}, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        return devices or 4
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except (OSError, ValueError) as e:
            raise RunError(f"no Ray cluster answers at {address} within {timeout_s:.0f} s "
                           f"({getattr(e, 'strerror', None) or e})") from None
    # In the main thread: Ray's SIGTERM handler (an exit, so the caller's cleanup runs)
    # is set only there. The probe above is what bounds the wait for a silent address;
    # an address that answers but is not Ray fails within Ray's own retries.
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001  ConnectionError, or the client's errors for ray://
        raise RunError(f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0]}") from None
    total = int(ray.cluster_resources().get(resource, 0))
    if total < 1:
        raise RunError(f"the Ray cluster at {address} has no {resource!r} resource (--resource names it)")
    return min(devices, total) if devices else total


def node_devices(resource: str) -> int:
    """The most ``resource`` one live node of the connected Ray cluster has."""
    import ray

    return max(int(node["Resources"].get(resource, 0)) for node in ray.nodes() if node["Alive"])


def scheduler_by_name(name: str, seed: int = 0) -> Scheduler:
    """``fifo``, ``srtf``, ``tiresias``, ``pollux``, ``ones`` (``jaxpar.elastic.baselines``),
    or ``module:attribute`` for a scheduler of one's own (a class or an instance)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise RunError(f"no scheduler {name}: {e}") from None
        return found() if isinstance(found, type) else found
    try:
        return by_name(name, seed)
    except ValueError as e:  # its message names the scheduler and the choices
        raise RunError(str(e)) from None
