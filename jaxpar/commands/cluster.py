"""``jaxpar-cluster``: schedulers on a cluster (issue 40).

``jaxpar-cluster run JOBS.yaml --scheduler NAME [--address ADDR]`` runs jobs on Ray
(``jaxpar.cluster.run``; ``jaxpar.cluster.jobs`` reads JOBS.yaml).

``jaxpar-cluster simulate TRACE --scheduler NAME --gpus N [--seed S] [--json]`` runs a
trace (a Philly ``.json``, a PAI ``.csv`` or ``synthetic:JOBS``) through the
discrete-event simulator (``jaxpar.elastic.simulator``) and prints the average and 99th
percentile job completion time and the makespan (``--json``: one object, every job's
JCT with it). One flat parser with a COMMAND positional rather than argparse
subcommands: every jaxpar command's parser takes flags among its positionals
(``CommandParser``), which subparsers do not allow. A command is one function in
``COMMANDS``; bad input (an unknown scheduler, a missing file, a bad trace, a job
bigger than the cluster) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys

from jaxpar.cluster.jobs import JobsError, load_jobs
from jaxpar.cluster.run import RunError, connect, node_devices, run_jobs, scheduler_by_name
from jaxpar.commands.common import CommandParser
from jaxpar.elastic.baselines import SCHEDULERS, by_name
from jaxpar.elastic.traces import TraceError, load


def _parser() -> CommandParser:
    parser = CommandParser(prog="jaxpar-cluster", description="Schedule training jobs on a shared cluster.")
    parser.add_argument("command", choices=list(COMMANDS),
                        help="simulate: run a trace in the simulator; run: run JOBS.yaml's jobs on Ray")
    parser.add_argument("source", metavar="TRACE", help="simulate: a Philly job log (.json), a PAI job table "
                        "(.csv) or synthetic:JOBS; run: JOBS.yaml")
    parser.add_argument("--scheduler", required=True, metavar="NAME",
                        help=f"one of {', '.join(SCHEDULERS)}")
    parser.add_argument("--gpus", type=int, metavar="N", help="the simulated cluster's devices")
    parser.add_argument("--seed", type=int, default=0, help="the trace's model draws and the scheduler's (default 0)")
    parser.add_argument("--round-s", type=float, default=60.0, help="seconds between scheduling rounds (default 60)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_arguments(parser)
    return parser


def simulate_command(args, parser: CommandParser) -> int:
    if args.gpus is None or args.gpus < 1:
        parser.error("simulate needs --gpus N, a positive number of devices")
    try:
        from jaxpar.elastic.simulator import SimulationError, simulate
    except ImportError as e:  # simpy: the cluster extra's
        parser.error(f"simulate needs the cluster extra ({e}): pip install 'jaxpar[cluster]'")
    try:
        scheduler = by_name(args.scheduler, args.seed)
        jobs = load(args.source, devices=args.gpus, seed=args.seed)
        result = simulate(jobs, scheduler, args.gpus, round_s=args.round_s)
    except (TraceError, SimulationError, ValueError, OSError) as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(f"{len(jobs)} jobs on {args.gpus} devices, {args.scheduler}:")
        print(f"  average JCT  {result.avg_jct_s / 3600:10.2f} h")
        print(f"  p99 JCT      {result.p99_jct_s / 3600:10.2f} h")
        print(f"  makespan     {result.makespan_s / 3600:10.2f} h")
    return 0


# run ----------------------------------------------------------------------------------------
#
# The one flat parser takes ``run JOBS.yaml``: JOBS.yaml is its TRACE positional,
# ``--scheduler``, ``--round-s`` and ``--seed`` are simulate's own, ``add_arguments`` adds
# the rest.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``run``'s own flags on jaxpar-cluster's parser."""
    parser.add_argument("--address", default=None, help="run: a Ray cluster (ray://head:10001, auto); default: "
                                                        "a local Ray instance with --devices declared devices")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="run: devices to schedule (local: default 4; a cluster: default all of --resource)")
    parser.add_argument("--devices-per-node", type=int, default=None, metavar="K",
                        help="run: the devices one node holds; a job given more runs as several jaxpar-train "
                             "processes (default: the largest node's; locally all, one node)")
    parser.add_argument("--resource", default="device", help="run: the Ray resource one device is "
                                                             "(GPU on a GPU cluster; default device)")
    parser.add_argument("--hardware", default=None, metavar="NAME",
                        help="run: the hardware profile JOBS.yaml's speed: plan predicts for (h100, a YAML file; "
                             "default: the present device's, as jaxpar-plan)")
    parser.add_argument("--work-dir", default="runs/cluster", help="run: where the jobs' run dirs and logs go "
                                                                   "(default runs/cluster)")


def _interrupt(signum, frame):
    """SIGTERM as Ctrl-C: the loop's cleanup runs (``KeyboardInterrupt(signum)``)."""
    raise KeyboardInterrupt(signum)


def run_command(args, parser) -> int:
    """``jaxpar-cluster run JOBS.yaml --scheduler NAME [--address ADDR]``: bad input is
    one line and exit 2; a run that cannot go on (no cluster, a job that fails) one line
    and exit 1; Ctrl-C or SIGTERM 130 or 143, every job stopped first. One JSON summary
    line per job."""
    try:
        jobs = load_jobs(args.source, args.hardware)
        scheduler = scheduler_by_name(args.scheduler, getattr(args, "seed", 0))
    except (JobsError, RunError) as e:
        parser.error(str(e))
    try:
        import ray  # here: Ray is the cluster extra's, which simulate does without
    except ImportError:
        parser.error("run needs Ray: pip install 'jaxpar[cluster]'")
    try:
        devices = connect(args.address, args.devices, args.resource)
        signal.signal(signal.SIGTERM, _interrupt)  # after ray.init: Ray's own handler aborts the driver
        per_node = args.devices_per_node or node_devices(args.resource)
        summary = run_jobs(jobs, scheduler, devices=devices, work_dir=pathlib.Path(args.work_dir),
                           round_s=args.round_s, resource=args.resource, per_node=per_node)
    except (RunError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"{parser.prog}: stopped by {signal.Signals(signum).name}; every job stopped", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if ray.is_initialized():
            ray.shutdown()
    for row in summary:
        print(json.dumps(row))
    return 0


COMMANDS = {"simulate": simulate_command, "run": run_command}


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args, parser)


def main_entry() -> None:
    sys.exit(main())
