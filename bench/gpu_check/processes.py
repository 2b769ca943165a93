"""Processes with a hard bound, run from a shim of this checkout.

Every process gpu_check starts (its parts, the training runs, ``bench/kernels.py``) runs
through ``run_bounded``: killed, with its whole process group when it has one of its
own, at its bound, or when this process is interrupted or sent SIGTERM. Each runs in the
shim's directory, with the shim first on ``PYTHONPATH``: ``make_shim`` lays out a
``jaxpar`` package of symbolic links into this checkout (``jaxpar/``'s files, and
``kernels/``, ``models/``, ``train/`` as pyproject.toml's package-dir maps them), so an
uninstalled checkout imports as the installed package, ahead of any installed copy.
Only the standard library: the orchestrator imports no JAX.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

PACKAGE = pathlib.Path(__file__).resolve().parent  # bench/gpu_check, run as `python bench/gpu_check`
ROOT = PACKAGE.parents[1]
# Where every process runs: the shim's directory, so that ``python -m jaxpar...`` (which
# puts the working directory first on sys.path) finds the shim's jaxpar, never the
# checkout's bare jaxpar/ without kernels, models and train. Set by ``use_shim``.
CWD: pathlib.Path | None = None


def shim_dir(work: pathlib.Path) -> pathlib.Path:
    return work / "shim"


def make_shim(directory: pathlib.Path) -> pathlib.Path:
    """``directory/jaxpar``: this checkout as the installed package lays it out, by links."""
    package = directory / "jaxpar"
    package.mkdir(parents=True)
    for entry in (ROOT / "jaxpar").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in ("kernels", "models", "train"):
        (package / name).symlink_to(ROOT / name)
    return directory


def use_shim(work: pathlib.Path) -> None:
    """Run every process from here on in the shim's directory (``work/shim``)."""
    global CWD
    CWD = shim_dir(work)


def self_command(*args: str) -> list[str]:
    """This package run again (``python bench/gpu_check ARGS``): a part, or a training run."""
    return [sys.executable, str(PACKAGE), *args]


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that ``run_bounded`` stops what it started (a part
    runs in a process group of its own, which a signal to ours does not reach)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (a zombie waiting for its parent's
    ``wait`` does not: it holds no memory)."""
    proc = pathlib.Path("/proc")
    if not proc.is_dir():  # no procfs: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group (a part and everything it started), SIGKILL 5 s on;
    returns once no process of the group runs (the leader's exit is not enough: what it
    started in the background may still be dying), or 10 s after the SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if process.poll() is not None and not group_alive(process.pid):
                return
            time.sleep(0.05)
    process.poll()


def stop(process: subprocess.Popen, group: bool) -> None:
    if group:
        kill_group(process)
    else:
        process.kill()
        process.wait()


def run_bounded(cmd: list[str], timeout: float, *, env=None, log=None, new_session=False) -> tuple[int | None, str]:
    """``(returncode or None if killed at the timeout, output)``, run in ``CWD``; the
    output also goes to ``log`` (a file object) when given. ``new_session``: a process
    group of its own, killed whole."""
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=CWD, text=True,
                                   start_new_session=new_session)
        try:
            code = process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            stop(process, new_session)
            code = None
        except BaseException:  # Ctrl-C, or SIGTERM (``exit_on_sigterm``): nothing left behind
            stop(process, new_session)
            raise
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write(text)
        log.flush()
    return code, text
