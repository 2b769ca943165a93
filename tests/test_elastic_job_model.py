"""The job model's speed from the planner's cost model (JOBS.yaml ``speed: plan``) and
refitted to measured step times while a job runs (issue 40 item 2)."""

import json
import math

import pytest

from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.planning import cost
from jaxpar.planning import hardware as hardware_lib
from jaxpar.planning.layout import Layout
from jaxpar.planning.workload import Workload
from jaxpar.cluster.jobs import JobsError, load_jobs
from jaxpar.cluster.run import Running
from jaxpar.train.config import load_config

TRUE = SpeedModel(0.05, 0.02, 0.3)
PRIOR = SpeedModel(0.01, 0.01, 0.005)


def test_one_measured_point_scales_the_prior_to_it():
    fitted = PRIOR.refit([(2, 16, TRUE.step_time(2, 16))])
    assert math.isclose(fitted.step_time(2, 16), TRUE.step_time(2, 16), rel_tol=1e-9)
    ratio = TRUE.step_time(2, 16) / PRIOR.step_time(2, 16)
    assert math.isclose(fitted.beta, PRIOR.beta * ratio, rel_tol=1e-9)
    assert PRIOR.refit([]) is PRIOR


def test_three_points_over_two_device_counts_recover_the_model():
    points = [(d, b, TRUE.step_time(d, b)) for d, b in [(1, 8), (1, 32), (4, 16)]]
    fitted = PRIOR.refit(points)
    for d, b in [(1, 8), (2, 16), (8, 64), (16, 16)]:
        assert math.isclose(fitted.step_time(d, b), TRUE.step_time(d, b), rel_tol=1e-6)
    one_count = [(1, b, TRUE.step_time(1, b)) for b in (8, 16, 32)]  # gamma unidentified: scaled prior instead
    assert PRIOR.refit(one_count).gamma > 0


def write(path, text):
    path.write_text(text)
    return path


def test_speed_plan_is_the_cost_models_prediction(tmp_path):
    jobs = write(tmp_path / "jobs.yaml", "- {id: a, config: tiny, steps: 10, devices: 2, max_devices: 8, "
                                         "batch_size: 16, min_batch: 8, max_batch: 32, speed: plan}\n")
    [job] = load_jobs(jobs, "h100")
    speed, cfg, hw = job.model.speed, load_config("tiny", []), hardware_lib.load("h100")
    for d in (1, 2, 4, 8):
        for b in (8, 16, 32):
            predicted = cost.step_time(Workload(cfg.model, b, cfg.seq_len), Layout(data=d), hw,
                                       devices_per_node=d).total
            assert abs(speed.step_time(d, b) / predicted - 1) < 0.1, (d, b)
    assert speed.throughput(8, 32) > 3 * speed.throughput(1, 32)
    write(jobs, "- {id: a, config: tiny, steps: 10, devices: 1, batch_size: 8, speed: plan}\n")
    with pytest.raises(JobsError, match=r"jobs.yaml:1: job 0 \(a\): speed: plan: .*'h900'"):
        load_jobs(jobs, "h900")


def test_a_running_job_is_seen_with_its_measured_speed_and_noise_scale(tmp_path):
    jobs = write(tmp_path / "jobs.yaml", "- {id: a, config: tiny, steps: 10, devices: 1, batch_size: 8, "
                                         "min_batch: 8, max_batch: 16, noise: 100}\n")
    [spec] = load_jobs(jobs)
    job = Running(spec, tmp_path, devices=2, segments=[(0, 1, 8), (4, 2, 16)])
    times = [5.0, 0.2, 0.25, 0.19] + [4.0, 0.15, 0.14]  # each segment's first step compiles
    noise = [float("nan")] * 6 + [42.0]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, (t, n) in enumerate(zip(times, noise), 1):
            f.write(json.dumps({"step": step, "loss": 1.0, "step_time_s": t, "noise_scale": n}) + "\n")
    view = job.view(now_s=0.0)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    (d1, b1, t1), (d2, b2, t2) = job.measured(records)
    assert (d1, b1, d2, b2) == (1, 8, 2, 16) and (t1, t2) == pytest.approx((0.2, 0.145))
    ratio = math.sqrt(0.2 / spec.model.speed.step_time(1, 8) * 0.145 / spec.model.speed.step_time(2, 16))
    assert math.isclose(view.model.speed.alpha, spec.model.speed.alpha * ratio, rel_tol=1e-9)
    assert view.model.noise == 42.0 and isinstance(view.model, JobModel)
    assert view.progress == 4 * 8 + 3 * 16
