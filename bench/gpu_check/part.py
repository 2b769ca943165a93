"""A part: one process of its own, bounded, that leaves a record.

The orchestrator (and the serve part, for its HTTP run) starts a part with ``run_part``:
``python bench/gpu_check --child NAME --work W --result R --deadline T [--smoke]`` in a
process group of its own, killed at its bound. In that process ``child_main`` runs the
part's function with a ``Record``, which the part saves after every change worth keeping
(a part killed at its bound keeps what it had), and whose ``status`` is ``ok``,
``failed`` (an exception: its one line) or ``skipped`` (``Skip``: why). Past ``--deadline``
(5 s before the kill) a part starts nothing new: ``time_left``. Also here: the small
helpers the orchestrator and the parts share. Only the standard library at import.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import pathlib
import sys
import time
import traceback

import processes

DEADLINE = math.inf  # this part's: past it, it starts nothing new


class Skip(Exception):
    """A part (or one of its runs) that cannot run here: ``skipped: <why>``."""


def write_json(path: pathlib.Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    tmp.replace(path)


class Record(dict):
    """A part's result, written to its file by ``save``."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = path

    def save(self) -> None:
        write_json(self.path, self)


def result_file(work: pathlib.Path, name: str) -> pathlib.Path:
    return work / f"part-{name}.json"


def read_result(work: pathlib.Path, name: str) -> dict:
    """What part ``name`` recorded in this run, ``{}`` if nothing (readable)."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads(result_file(work, name).read_text())
    return {}


def run_part(name: str, work: pathlib.Path, until: float, smoke: bool, *, env=None, log=None):
    """Part ``name`` in a process group of its own, killed at ``until`` (it stops starting
    things 5 s before): ``(exit code or None if killed, output, its record, seconds)``."""
    result = result_file(work, name)
    cmd = processes.self_command("--child", name, "--work", str(work), "--result", str(result),
                                 "--deadline", str(until - 5), *(["--smoke"] if smoke else []))
    started = time.time()
    code, text = processes.run_bounded(cmd, until - time.time(), env=env, log=log, new_session=True)
    return code, text, read_result(work, name), time.time() - started


def child_main(argv: list[str], parts: dict) -> int:
    """``--child NAME ...``: run ``parts[NAME](ns, rec)``; exit 1 if it failed."""
    global DEADLINE
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=sorted(parts))
    p.add_argument("--work", type=pathlib.Path, required=True)
    p.add_argument("--result", type=pathlib.Path, required=True)
    p.add_argument("--deadline", type=float, required=True)
    p.add_argument("--smoke", action="store_true")
    ns = p.parse_args(argv)
    DEADLINE = ns.deadline
    processes.use_shim(ns.work)
    processes.exit_on_sigterm()
    rec = Record(ns.result)
    try:
        parts[ns.part](ns, rec)
    except Skip as e:
        rec["status"], rec["reason"] = "skipped", f"skipped: {e}"
    except Exception as e:  # noqa: BLE001 - the part's failure, recorded
        traceback.print_exc()
        rec["status"], rec["reason"] = "failed", short(e)
    rec.setdefault("status", "failed")
    rec.save()
    return 1 if rec["status"] == "failed" else 0


def time_left() -> float:
    return DEADLINE - time.time()


def short(e: BaseException | str, limit: int = 160) -> str:
    """One line of an exception (or a text's last non-empty line)."""
    if isinstance(e, BaseException):
        lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
        text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    else:
        lines = [l.strip() for l in e.strip().splitlines() if l.strip()]
        text = lines[-1] if lines else ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def missing(modules) -> list[str]:
    """Those of ``modules`` (dotted names allowed) that do not import here."""
    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except Exception:  # noqa: BLE001 - a parent package that is missing or does not import
            return True

    return [m for m in modules if absent(m)]


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table, as BENCHMARKS.md prints them, indented for summary.txt."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return ["  " + l for l in lines]


def load_bench(name: str):
    """``bench/<name>.py`` as a module (its tables and helpers)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", processes.ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
