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

import json
import sys

from jaxpar.cluster import run as cluster_run
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
    cluster_run.add_arguments(parser)
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


COMMANDS = {"simulate": simulate_command, "run": cluster_run.run_command}


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args, parser)


def main_entry() -> None:
    sys.exit(main())
