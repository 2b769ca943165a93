"""The trace simulator (jaxpar.elastic.simulator), the baseline schedulers, the trace
readers and ``jaxpar-cluster simulate``: hand-computed JCTs on tiny traces, the rules
every scheduler keeps on a synthetic one, and every bad input as one line."""

import dataclasses
import json

import pytest

from jaxpar.elastic.baselines import SCHEDULERS, Tiresias, by_name
from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.elastic.scheduler import JobView
from jaxpar.elastic.simulator import simulate
from jaxpar.elastic.traces import Job, TraceError, load, read_pai, read_philly, synthetic
from jaxpar.commands import cluster

# One sample per second on any device count (alpha = 1 s per step of batch 1, no compute
# or sync term): a job's target in samples is its work in seconds, whatever it runs on.
UNIT = JobModel(SpeedModel(1.0, 0.0, 0.0), base_batch=1)


def unit_job(job_id, arrival_s, devices, seconds, restart_s=10.0):
    return Job(job_id, arrival_s, UNIT, float(seconds), devices, restart_s=restart_s)


@pytest.mark.parametrize("name", ["fifo", "srtf", "tiresias"])
def test_one_job_takes_its_isolated_time_plus_one_restart(name):
    # step_time(2, 10) = 0.1 + 0.01 * 10 / 2 = 0.15 s for 10 samples: 66.67 samples/s, so
    # 6000 samples take 90 s, after the 30 s start: JCT 120 s, whenever it arrives.
    model = JobModel(SpeedModel(0.1, 0.01, 0.0), base_batch=10)
    job = Job("a", 100.0, model, 6000.0, 2, restart_s=30.0)
    assert job.isolated_s == pytest.approx(90.0)
    result = simulate([job], by_name(name), devices=4)
    assert result.jct_s == {"a": pytest.approx(120.0)}
    assert result.makespan_s == pytest.approx(120.0) and result.avg_jct_s == pytest.approx(120.0)


THREE = [unit_job("A", 0, 2, 100), unit_job("B", 10, 4, 20), unit_job("C", 20, 1, 50)]  # on 4 devices


def test_fifo_three_jobs_by_hand():
    # A starts at 0: restart to 10, 100 s of work: done at 110 (JCT 110).
    # B (4 devices) does not fit beside A; C (1 device) would, but waits behind B
    # (head-of-line blocking). At 110 B starts: 110 + 10 + 20 = 140 (JCT 130). C waits
    # for B's devices: 140 + 10 + 50 = 200 (JCT 180).
    result = simulate(THREE, by_name("fifo"), devices=4)
    assert result.jct_s == pytest.approx({"A": 110.0, "B": 130.0, "C": 180.0})
    assert result.avg_jct_s == pytest.approx(140.0) and result.makespan_s == pytest.approx(200.0)


def test_srtf_three_jobs_by_hand():
    # 0: A alone starts (restart to 10). 10: B arrives, 20 s left against A's 100: B takes
    # all 4 devices, A is preempted (it never got past its restart). B: 10 + 10 + 20 = 40
    # (JCT 30). 20: C (50 s) arrives; B still shortest, C does not fit. 40: C (50) and A
    # (100) both fit (1 + 2 devices), each pays a restart: C at 40 + 10 + 50 = 100
    # (JCT 80), A at 40 + 10 + 100 = 150 (JCT 150).
    result = simulate(THREE, by_name("srtf"), devices=4)
    assert result.jct_s == pytest.approx({"A": 150.0, "B": 30.0, "C": 80.0})
    assert result.avg_jct_s == pytest.approx(260.0 / 3) and result.makespan_s == pytest.approx(150.0)


def test_tiresias_three_jobs_by_hand():
    # Nobody reaches 18,000 device-seconds: one queue, arrival order, skipping what does
    # not fit. A runs 0 -> 110 (JCT 110); B (4) never fits beside A and is skipped; C
    # starts at 20: 20 + 10 + 50 = 80 (JCT 60); B starts at 110: 140 (JCT 130).
    result = simulate(THREE, by_name("tiresias"), devices=4)
    assert result.jct_s == pytest.approx({"A": 110.0, "B": 130.0, "C": 60.0})


def test_tiresias_demotes_a_job_past_its_threshold():
    def view(job_id, arrival, attained, devices):
        return JobView(job_id, arrival, UNIT, 1e6, 0.0, 4, devices=devices, batch=1 if devices else None,
                       attained_service_s=attained)

    old, new = view("old", 0.0, 20_000.0, 4), view("new", 50.0, 0.0, 0)
    assert Tiresias().decide(100.0, [old, new], 4).keys() == {"new"}
    assert Tiresias(thresholds_s=(30_000.0,)).decide(100.0, [old, new], 4).keys() == {"old"}


@pytest.fixture(scope="module")
def trace():
    """14 synthetic jobs on 8 devices, two of them needing at least 2."""
    jobs = synthetic(14, seed=3, interarrival_s=600.0, max_devices=8)
    return [dataclasses.replace(j, min_devices=2, requested_devices=max(j.requested_devices, 2))
            if i % 5 == 0 else j for i, j in enumerate(jobs)]


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.slow
def test_every_scheduler_keeps_the_cluster_and_each_minimum(name, trace):
    result = simulate(trace, by_name(name, seed=0), devices=8, round_s=1800.0)
    minimum = {j.id: j.min_devices for j in trace}
    assert result.rounds
    for r in result.rounds:
        assert sum(a.devices for a in r.allocations.values()) <= 8
        assert all(a.devices >= minimum[job_id] and a.batch >= 1 for job_id, a in r.allocations.items())
    assert set(result.jct_s) == set(minimum) and min(result.jct_s.values()) > 0
    assert result.p99_jct_s <= max(result.jct_s.values()) and result.makespan_s >= max(result.jct_s.values())


def test_a_run_is_deterministic_for_a_seed(trace):
    first, again = (simulate(trace[:6], by_name("ones", seed=1), devices=8, round_s=1800.0) for _ in range(2))
    assert first.summary() == again.summary() and first.rounds == again.rounds
    assert synthetic(20, seed=5) == synthetic(20, seed=5) != synthetic(20, seed=6)


def test_a_job_bigger_than_the_cluster_is_one_line():
    with pytest.raises(TraceError, match=r"^job B asks for 4 devices; the cluster has 2$"):
        simulate(THREE, by_name("fifo"), devices=2)


# --- Philly ---------------------------------------------------------------------------

def philly_job(jobid, submitted, attempts, status="Pass"):
    return {"status": status, "vc": "vc1", "jobid": jobid, "user": "u", "submitted_time": submitted,
            "attempts": [{"start_time": s, "end_time": e,
                          "detail": [{"ip": f"m{k}", "gpus": [f"gpu{g}" for g in range(n)]} for k, n in enumerate(gpus)]}
                         for s, e, gpus in attempts]}


def test_philly_reader(tmp_path):
    log = [
        philly_job("app_2", "2017-10-03 02:00:00", [("2017-10-03 02:01:00", "2017-10-03 03:01:00", [2]),
                                                     ("2017-10-03 04:00:00", "2017-10-03 04:30:00", [4, 4])]),
        philly_job("app_1", "2017-10-03 01:00:00", [("2017-10-03 01:00:10", "2017-10-03 01:10:10", [1])], "Killed"),
        philly_job("app_3", "2017-10-03 05:00:00", [(None, None, [])], "Failed"),  # never ran: left out
    ]
    path = tmp_path / "cluster_job_log"  # the published file's name, no suffix
    path.write_text(json.dumps(log))
    jobs = load(str(path), seed=0)
    assert [j.id for j in jobs] == ["app_1", "app_2"]
    assert [j.arrival_s for j in jobs] == [0.0, 3600.0]
    assert [j.requested_devices for j in jobs] == [1, 8]  # the most GPUs an attempt held
    assert [j.isolated_s for j in jobs] == pytest.approx([600.0, 5400.0])  # attempts' run times summed
    assert read_philly(path, seed=0) == jobs


@pytest.mark.parametrize("edit, message", [
    (lambda log: log[1].pop("submitted_time"), r"job 1: no 'submitted_time' field$"),
    (lambda log: log[0]["attempts"][0].pop("detail"), r"job 0 \(app_a\): attempt 0 has no 'detail' field$"),
    (lambda log: log[1].update(submitted_time="yesterday"), r"job 1 \(app_b\): submitted_time 'yesterday' is not"),
    (lambda log: log[0]["attempts"][0]["detail"][0].pop("gpus"), r"job 0 \(app_a\): attempt 0 detail 0 has no 'gpus'"),
])
def test_philly_bad_input_names_the_job_and_field(tmp_path, edit, message):
    log = [philly_job("app_a", "2017-10-03 01:00:00", [("2017-10-03 01:00:00", "2017-10-03 02:00:00", [1])]),
           philly_job("app_b", "2017-10-03 01:30:00", [("2017-10-03 01:30:00", "2017-10-03 02:00:00", [2])])]
    edit(log)
    path = tmp_path / "log.json"
    path.write_text(json.dumps(log))
    with pytest.raises(TraceError, match=message) as e:
        read_philly(path)
    assert "\n" not in str(e.value)


def test_philly_log_that_is_not_a_list(tmp_path):
    (tmp_path / "log.json").write_text('{"jobid": 1}')
    with pytest.raises(TraceError, match="a Philly job log is a JSON list of jobs"):
        read_philly(tmp_path / "log.json")


# --- PAI --------------------------------------------------------------------------------

PAI_JOBS = """\
j1,i1,u1,Terminated,1000.0,4600.0
j2,i2,u1,Failed,1500.0,2100.0
j3,i3,u2,Running,1600.0,
j4,i4,u2,Terminated,1700.0,1800.0
"""
PAI_TASKS = """\
j1,worker,4.0,Terminated,1010.0,4600.0,600.0,29.3,100.0,V100
j1,ps,1.0,Terminated,1010.0,4600.0,600.0,29.3,0.0,
j2,tensorflow,2.0,Failed,1500.0,2100.0,400.0,10.0,50.0,MISC
j3,worker,1.0,Running,1600.0,,400.0,10.0,100.0,P100
j4,worker,1.0,Terminated,1700.0,1800.0,400.0,10.0,,
"""


def test_pai_reader_with_the_task_table_beside_it(tmp_path):
    # The published files have no header row. j1: 4 workers of 100% -> 4 GPUs, the ps
    # none; j2: 2 instances of 50% -> 1 GPU; j3 still running and j4 CPU-only: left out.
    (tmp_path / "pai_job_table.csv").write_text(PAI_JOBS)
    (tmp_path / "pai_task_table.csv").write_text(PAI_TASKS)
    jobs = read_pai(tmp_path / "pai_job_table.csv")
    assert [(j.id, j.arrival_s, j.requested_devices) for j in jobs] == [("j1", 0.0, 4), ("j2", 500.0, 1)]
    assert [j.isolated_s for j in jobs] == pytest.approx([3600.0, 600.0])


def test_pai_reader_with_a_header_and_plan_gpu(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("job_name,inst_id,user,status,start_time,end_time,plan_gpu\n"
                    "a,i,u,Terminated,0,100,800\nb,i,u,Terminated,50,60,50\n")
    assert [(j.id, j.requested_devices) for j in read_pai(path)] == [("a", 8), ("b", 1)]


@pytest.mark.parametrize("text, message", [
    ("j1,i1,u1,Terminated,1000.0,4600.0\nj2,i2,u1,Failed,1500.0\n", r"line 2: no 'end_time' \(5 fields of 6\)$"),
    ("job_name,inst_id,user,status,end_time,plan_gpu\na,i,u,Terminated,1,100\n",
     r"line 1: no column 'start_time' in the header$"),
    ("j1,i1,u1,Terminated,soon,4600.0\n", r"line 1: start_time 'soon' is not a number$"),
])
def test_pai_bad_input_names_the_line_and_column(tmp_path, text, message):
    (tmp_path / "pai_job_table.csv").write_text(text)
    (tmp_path / "pai_task_table.csv").write_text(PAI_TASKS)
    with pytest.raises(TraceError, match=message):
        read_pai(tmp_path / "pai_job_table.csv")


def test_pai_without_gpu_counts_says_so(tmp_path):
    (tmp_path / "jobs.csv").write_text(PAI_JOBS)
    with pytest.raises(TraceError, match="no plan_gpu column and no task table"):
        read_pai(tmp_path / "jobs.csv")


# --- jaxpar-cluster ---------------------------------------------------------------------

def cli(capsys, *args):
    try:
        code = cluster.main([*map(str, args)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json(capsys):
    code, out, err = cli(capsys, "simulate", "synthetic:6", "--scheduler", "srtf", "--gpus", 8, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert {"avg_jct_s", "p99_jct_s", "makespan_s", "jobs"} <= summary.keys()
    assert [j["id"] for j in summary["jobs"]] == [f"job{i}" for i in range(6)]
    assert all(j["jct_s"] > 0 for j in summary["jobs"])
    code, out, _ = cli(capsys, "simulate", "synthetic:6", "--gpus", 8, "--scheduler", "fifo")
    assert code == 0 and "average JCT" in out


def test_the_readmes_ones_simulation_runs_on_fewer_jobs(capsys):
    """README: ``jaxpar-cluster simulate synthetic:300 --scheduler ones --gpus 64 --json``
    on 2 jobs of the synthetic trace (300 take ONES's search 5 minutes on 2 cores, 2
    about 1 s): every job finishes, and the summary agrees with the jobs' JCTs."""
    code, out, err = cli(capsys, "simulate", "synthetic:2", "--scheduler", "ones", "--gpus", 64, "--json")
    assert code == 0, err
    summary = json.loads(out)
    jcts = [j["jct_s"] for j in summary["jobs"]]
    assert [j["id"] for j in summary["jobs"]] == [f"job{i}" for i in range(2)] and min(jcts) > 0
    assert abs(summary["avg_jct_s"] - sum(jcts) / 2) <= 1e-9 * summary["avg_jct_s"]
    assert max(jcts) <= summary["makespan_s"]


def test_cli_bad_input_is_one_line_exit_2(capsys, tmp_path):
    big = tmp_path / "big.json"
    big.write_text(json.dumps([philly_job("huge", "2017-10-03 01:00:00",
                                          [("2017-10-03 01:00:00", "2017-10-03 02:00:00", [8, 8])])]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"jobid": "x", "status": "Pass", "attempts": []}]))
    cases = [
        (["synthetic:4", "--scheduler", "lottery", "--gpus", 8], "no scheduler 'lottery'; choose from fifo"),
        ([tmp_path / "missing.json", "--scheduler", "fifo", "--gpus", 8], "missing.json: no such file"),
        ([bad, "--scheduler", "fifo", "--gpus", 8], "job 0: no 'submitted_time' field"),
        ([big, "--scheduler", "fifo", "--gpus", 8], "job huge asks for 16 devices; the cluster has 8"),
        (["synthetic:4", "--scheduler", "fifo"], "simulate needs --gpus N"),
    ]
    for args, message in cases:
        code, out, err = cli(capsys, "simulate", *args)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (args, err)
        assert err.startswith("jaxpar-cluster: error: ") and message in err, err


def test_a_scheduler_whose_module_is_missing_is_a_clear_error(monkeypatch):
    from jaxpar.elastic import baselines

    monkeypatch.setitem(baselines.SCHEDULERS, "gone", baselines._lazy("gone", "Gone"))
    with pytest.raises(ValueError, match=r"^scheduler 'gone' is not available: jaxpar.elastic.gone.Gone is missing$"):
        by_name("gone")
