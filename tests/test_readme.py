"""The README's shell blocks run as written after its quickstart, in the same shell (its
virtual environment active): every command they name is installed, every script and
file they name is in the checkout, every ``jaxpar-train`` line is a valid config and
every ``jaxpar-generate`` / ``jaxpar-serve`` line parses; the cheap ones run.

A block the quickstart's shell cannot run as written (a SLURM batch script, your own
config) is marked with an HTML comment on the line before its fence,
``<!-- not run: WHY -->``; one that this file runs, ``<!-- run -->``.
"""

import importlib
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest

from jaxpar.train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
VENV_BIN = pathlib.Path(sys.executable).parent  # the quickstart's .venv/bin when it runs the suite
SHELL_BUILTINS = {"cd", "export", ".", "source", "for", "do", "done", "if", "then", "fi", "echo"}


def shell_blocks() -> list[tuple[int, str, str]]:
    """``(line, mark, text)`` of every ```bash block: ``mark`` is ``"run"``, ``"not run"``
    or ``""`` (checked, not run)."""
    blocks = []
    for m in re.finditer(r"^```bash\n(.*?)^```", README, re.S | re.M):
        before = README[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = re.fullmatch(r"<!-- (run|not run)(: .+)? -->", before)
        blocks.append((README[:m.start()].count("\n") + 1, mark[1] if mark else "", m.group(1)))
    return blocks


def logical_lines(text: str) -> list[str]:
    """``text`` cut at the newlines a shell ends a command at: not after ``\\``, not
    inside quotes."""
    lines, current, quote, escaped = [], "", None, False
    for char in text:
        if char == "\n" and not quote and not escaped:
            lines.append(current)
            current = ""
            continue
        current += char
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif char in "'\"" and quote in (None, char):
            quote = None if quote else char
    return lines + [current]


def commands(text: str) -> list[list[str]]:
    """The simple commands of a block, as shell words (comments dropped, split at ``&&``,
    ``||``, ``;`` and ``|``), and the first word of each ``$(...)`` as a command of its
    own."""
    out = [[m] for m in re.findall(r"\$\((\S+)", text)]
    for line in logical_lines(text):
        current = []
        for word in shlex.split(line.replace("\\\n", " "), comments=True) + [";"]:
            if word in ("&&", "||", ";", "|"):
                if current:
                    out.append(current)
                current = []
            else:
                current.append(word)
    return out


def named_command(words: list[str]) -> str | None:
    """The program a simple command runs (after ``VAR=value`` assignments)."""
    for word in words:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*=.*", word):
            return word
    return None


BLOCKS = shell_blocks()
CHECKED = [(line, text) for line, mark, text in BLOCKS if mark != "not run"]


def test_the_readme_has_its_two_commands_and_ci_runs_the_test_command():
    """The main job and the test command are the README's first two blocks, both start
    by activating the virtual environment, and .ci/run runs the second exactly."""
    main, tests = BLOCKS[0][2].strip(), BLOCKS[1][2].strip()
    for command in (main, tests):
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && "), command
    assert "jaxpar-train tiny" in main and "python -m pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("line,text", CHECKED, ids=[f"README.md:{line}" for line, _ in CHECKED])
def test_every_command_and_file_a_block_names_exists(line, text):
    """Each command is on the quickstart venv's PATH (or a shell builtin, or installed by
    a ``pip install`` earlier in the block); each ``*.py``, ``*.yaml`` and ``*.sh`` it
    names relative to the checkout is there."""
    installed = set()
    for words in commands(text):
        name = named_command(words)
        if name is None or name in SHELL_BUILTINS:
            continue
        if name == "pip" and words[1:2] == ["install"]:
            installed |= {w.split("[")[0].split("=")[0] for w in words[2:] if not w.startswith("-")}
        found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        assert found or name in installed, f"README.md:{line}: {name!r} is not installed"
        for word in words[1:]:
            if re.fullmatch(r"[\w./-]+\.(py|yaml|sh)", word) and "/" in word:
                assert (ROOT / word).is_file(), f"README.md:{line}: no {word} in the checkout"


def _argv(text: str, program: str) -> list[list[str]]:
    """The arguments of every ``program`` command in ``text`` (``$VAR`` / ``$(...)``
    words stand for a path)."""
    return [[re.sub(r"\$\{?\w+\}?|\$\(.*\)", "x", w) for w in words[1:]] for words in commands(text)
            if named_command(words) == program]


def test_every_jaxpar_command_in_the_readme_parses():
    """``jaxpar-train`` lines load as configs (every key and value valid; but in a block
    not run, which may name your own config file), as ``jaxpar-plan`` lines do;
    ``jaxpar-generate`` and ``jaxpar-serve`` lines parse with the commands' own parsers."""
    seen = set()
    for line, mark, text in BLOCKS:
        for program in SCRIPTS:
            for argv in _argv(text, program):
                seen.add(program)
                module = importlib.import_module(SCRIPTS[program].split(":")[0])
                args = module._parser().parse_args(argv)
                if program == "jaxpar-train" and mark != "not run":
                    load_config(args.config, args.overrides)
                if program == "jaxpar-plan" and args.config:  # its devices=N: plan.devices=N
                    load_config(args.config, module._split_aliases(args.overrides))
    assert seen == set(SCRIPTS)


def _run_blocks():
    return [(line, text) for line, mark, text in BLOCKS if mark == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("line,text", _run_blocks(), ids=[f"README.md:{line}" for line, _ in _run_blocks()])
def test_the_cheap_blocks_run(line, text):
    """The blocks marked to run, as written, in bash in the checkout with the venv's bin
    first on PATH: where the quickstart's shell is. (They write nothing there: a block
    that would belongs to the checked ones.)"""
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"README.md:{line}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
