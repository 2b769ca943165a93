"""The README's shell blocks run as written after its quickstart, in the same shell (its
virtual environment active): every command they name is installed, every script and
file they name is in the checkout, every ``jaxpar-train`` line is a valid config and
every ``jaxpar-generate`` / ``jaxpar-serve`` line parses; the cheap ones run.

Every block with a ``jaxpar-*`` command carries a mark on the line before its fence
(an unmarked one fails test_every_jaxpar_block_is_marked):

* ``<!-- run -->``: this file runs it as written (test_the_cheap_blocks_run);
* ``<!-- run by: tests/FILE.py::test_name[, tests/OTHER.py::test_other] -->``: the named
  tests run its ``jaxpar-*`` commands, as written or with overrides that only shorten
  them (steps, files, rows, requests, layers); ``<!-- run by (NOTE): ... -->`` where
  they differ otherwise (a smaller model where the README's cannot train in CI), NOTE
  saying how;
* ``<!-- not run: WHY -->``: the quickstart's shell cannot run it (a SLURM script, your
  own data, a GPU, a Ray cluster), or CI cannot afford it; WHY says which and what
  test covers the feature instead.

A ``run by`` mark is checked by text, not by running anything (run_by_problems): each
named test exists (its file defines the function; a parametrized id is allowed), and
for every ``jaxpar-*`` command line of the block, one of the named tests' source (the
test function with its decorators, and the module-level functions, fixtures, constants
and imports it names, followed transitively) mentions what the line runs: its program
(``jaxpar-train``, ``jaxpar.commands.train`` or its ``main``, ``train(load_config(`` ...),
a config or plain positional (``"dlrm"``, ``"simulate"``, ``synthetic:``), each option
(``--method``) and its word value (``cape``), and each ``key=`` override, with its value
where that is a word (``data.format=criteo``) or a mesh axis's size. Overrides that only
shorten a run (FREE_KEYS: steps, run_dir, batch_size, seq_len, files, rows, layers ...),
other numbers and paths are not required; anything else a test does differently is
named in the mark's NOTE as ``not X``, which waives X (``run by (on tiny, not 1b): ...``).
The check cannot see what a test adds (a setting the README line leaves out), nor a
size: the mark's NOTE says those.
"""

import ast
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


MARK = re.compile(r"<!-- (run|not run)(: .+)? -->|<!-- (run by)(?: \(.+\))?: tests/.+ -->")
ALLOWED_MARKS = ("<!-- run -->, <!-- run by: tests/FILE.py::test_name[, tests/OTHER.py::test_other] --> "
                 "(or <!-- run by (NOTE): ... --> where the tests differ from the block by more than "
                 "shortening), or <!-- not run: WHY -->")


def shell_blocks() -> list[tuple[int, str, str]]:
    """``(line, mark, text)`` of every ```bash block: ``mark`` is ``"run"``, ``"run by"``,
    ``"not run"`` or ``""`` (checked, not run); ``line`` is the fence's."""
    blocks = []
    for m in re.finditer(r"^```bash\n(.*?)^```", README, re.S | re.M):
        mark = MARK.fullmatch(_line_before(m.start()))
        kind = (mark[1] or mark[3]) if mark else ""
        blocks.append((README[:m.start()].count("\n") + 1, kind, m.group(1)))
    return blocks


def _line_before(at: int) -> str:
    return README[:at].rstrip("\n").rsplit("\n", 1)[-1]


def run_by_mark(line: int) -> tuple[str, list[str]]:
    """``(note, tests)`` of the ``run by`` mark before the fence on README line ``line``."""
    before = README.splitlines()[:line - 1]
    while before and not before[-1]:
        before.pop()
    m = re.fullmatch(r"<!-- run by(?: \((?P<note>.*)\))?: (?P<tests>.+) -->", before[-1])
    return m["note"] or "", [t.strip() for t in m["tests"].split(",")]


def logical_lines(text: str) -> list[str]:
    """``text`` cut at the newlines a shell ends a command at: not after ``\\``, not
    inside quotes; comments left out."""
    lines, current, quote, escaped, comment = [], "", None, False, False
    for char in text:
        if char == "\n" and not quote and not escaped:
            lines.append(current)
            current, comment = "", False
            continue
        if comment or (char == "#" and not quote and not escaped and current[-1:] in ("", " ", "\t", "\n")):
            comment = True  # to the line's end: a quote in it ("SmolLM2's") opens nothing
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


def jaxpar_commands(text: str) -> list[list[str]]:
    """The block's ``jaxpar-*`` commands, from the program's word on (``srun
    .venv/bin/jaxpar-train ...`` included)."""
    out = []
    for words in commands(text):
        for i, word in enumerate(words):
            if word.rsplit("/", 1)[-1] in SCRIPTS:
                out.append([word.rsplit("/", 1)[-1], *words[i + 1:]])
                break
    return out


# Overrides a test may change or leave out: they only shorten a run (or say where it writes).
FREE_KEYS = {"steps", "run_dir", "cache_dir", "batch_size", "seq_len", "eval.every", "eval.batches",
             "checkpoint.every", "data.max_files", "glide.train_rows", "model.layers"}


def _program_pattern(program: str) -> str:
    name = program.removeprefix("jaxpar-")
    pattern = rf"jaxpar-{name}\b|jaxpar\.commands\.{name}\b|from jaxpar\.commands import [\w, ]*\b{name}\b"
    if name == "train":  # jaxpar.train.loop.train on a loaded config: what the command's main calls
        pattern += r"|\btrain\((load_)?config\(|\btrain\(cfg\b"
    return pattern


def _is_word(value: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][\w-]*", value) is not None


def requirements(words: list[str]) -> list[tuple[str, str]]:
    """``(what, regex)`` pairs a test that runs jaxpar command ``words`` mentions: the
    program; each positional but a path or number (a word quoted, ``"dlrm"``; a trailing
    count dropped, ``synthetic:300`` as ``synthetic:``); each option, and its value if a
    word (``cape``); each override's ``key=`` but FREE_KEYS', and ``key=value`` if the
    value is a word (``data.format=criteo``) or the key a mesh axis (``mesh.fsdp=4``: the
    layout is what the line shows)."""
    program, *args = words
    needs, i = [(program, _program_pattern(program))], 0
    while i < len(args):
        word, i = args[i], i + 1
        if word.startswith("-"):
            needs.append((word, re.escape(word) + r"(?![\w-])"))
            if i < len(args) and not args[i].startswith("-") and "=" not in args[i]:
                value, i = args[i], i + 1
                if _is_word(value):
                    needs.append((value, rf"\b{re.escape(value)}\b"))
        elif "=" in word:
            key, value = word.split("=", 1)
            if key not in FREE_KEYS:
                needs.append((f"{key}=", re.escape(f"{key}=")))
                if _is_word(value) or key.startswith("mesh."):
                    needs.append((word, re.escape(word) + r"(?![\w-])"))
        elif not re.search(r"[/$.]", word) and (stem := re.sub(r"\d+$", "", word)):
            needs.append((stem, rf"[\"']{stem}[\"']" if _is_word(stem) else re.escape(stem)))
    return needs


def source_of(path: pathlib.Path, name: str) -> str | None:
    """What a ``run by`` check reads of test ``name`` in ``path``: the function with its
    decorators, then every module-level function, class, constant and import it names
    (its fixtures by argument name), and what those name, transitively. None if the
    module defines no such test function."""
    text = path.read_text()
    lines, defs = text.splitlines(), {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        for n in names:
            defs.setdefault(n, []).append((node, "\n".join(lines[first - 1:node.end_lineno])))
    if not name.startswith("test_") or not any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                                               for node, _ in defs.get(name, [])):
        return None
    parts, seen, todo = [], set(), [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for node, source in defs.get(n, []):
            parts.append(source)
            todo += [x.id for x in ast.walk(node) if isinstance(x, ast.Name)]
            todo += [x.arg for x in ast.walk(node) if isinstance(x, ast.arg)]
    return "\n".join(parts)


def run_by_problems(note: str, tests: list[str], text: str, root: pathlib.Path = ROOT) -> list[str]:
    """What is wrong with a ``run by (note): tests`` mark on a block of ``text``: a named
    test that does not exist, or a jaxpar-* line none of the named tests mentions all of
    (requirements, less what ``note`` names as ``not X``: the deviations the mark
    declares; never the program). Empty: nothing."""
    problems, sources = [], []
    for test in tests:
        path, _, name = test.partition("::")
        name = name.split("[")[0]
        if not re.fullmatch(r"tests/[\w/]+\.py", path) or not name:
            problems.append(f"{test}: not tests/FILE.py::test_name")
        elif not (root / path).is_file():
            problems.append(f"{test}: no {path}")
        elif (source := source_of(root / path, name)) is None:
            problems.append(f"{test}: {path} defines no {name}")
        else:
            sources.append(source)
    if problems:
        return problems
    if not jaxpar_commands(text):
        return ["the block runs no jaxpar-* command"]
    for words in jaxpar_commands(text):
        needs = [(what, pattern) for what, pattern in requirements(words) if what == words[0] or not re.search(
            rf"\bnot {re.escape(what)}" + (r"(?![\w-]|\.\w)" if what[-1].isalnum() else ""), note)]
        missing = min(([what for what, pattern in needs if not re.search(pattern, source)] for source in sources),
                      key=len)
        if missing:
            problems.append(f"{shlex.join(words)}: the closest of {', '.join(tests)} does not mention {missing} "
                            "(where a test runs it otherwise, the mark's note names what as `not X`)")
    return problems


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


def test_every_jaxpar_block_is_marked():
    """A block with a ``jaxpar-*`` command says how it is run: ``run``, ``run by`` or ``not run``."""
    unmarked = [f"README.md:{line}: a ```bash block running {', '.join(sorted({w[0] for w in jaxpar_commands(text)}))} "
                "has no mark" for line, mark, text in BLOCKS if not mark and jaxpar_commands(text)]
    assert not unmarked, "\n".join(unmarked) + f"\n(on the line before its fence: {ALLOWED_MARKS})"


RUN_BY = [(line, text) for line, mark, text in BLOCKS if mark == "run by"]


@pytest.mark.parametrize("line,text", RUN_BY, ids=[f"README.md:{line}" for line, _ in RUN_BY])
def test_the_tests_a_block_is_run_by_exist_and_run_its_commands(line, text):
    """Each ``run by`` mark's tests exist and mention what each jaxpar-* line runs."""
    problems = run_by_problems(*run_by_mark(line), text)
    assert not problems, f"README.md:{line}:\n" + "\n".join(problems)


def test_the_run_by_check_fails_on_what_the_tests_do_not_run(tmp_path):
    """run_by_problems on a made-up block: a test file or function that does not exist,
    a test that runs another data format, one that names the settings but runs no
    trainer; passes a test that reaches them through its helper and constant, and the
    other format where the mark's note names it. The block finder sees a jaxpar command
    after a comment with a quote in it, and under ``srun``."""
    block = "# the made-up test's\njaxpar-train dlrm data.format=criteo data.path=day_0.gz steps=300\n"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_made_up.py").write_text(
        "from jaxpar.train.loop import train\n"
        "ARGS = ['data.format=criteo', 'steps=2']\n\n"
        "def data(path):\n    return [f'data.path={path}', *ARGS]\n\n"
        "def test_runs_it(tmp_path):\n    train(load_config('dlrm', data(tmp_path)))\n\n"
        "def test_runs_another_format(tmp_path):\n"
        "    train(load_config('dlrm', ['data.format=synthetic', f'data.path={tmp_path}']))\n\n"
        "def test_runs_nothing():\n    assert ['dlrm', 'data.format=criteo', 'data.path=x']\n")
    check = lambda *tests, note="": run_by_problems(note, list(tests), block, tmp_path)  # noqa: E731
    assert check("tests/test_no_such_file.py::test_x") == ["tests/test_no_such_file.py::test_x: no "
                                                           "tests/test_no_such_file.py"]
    assert check("tests/test_made_up.py::test_absent") == ["tests/test_made_up.py::test_absent: "
                                                           "tests/test_made_up.py defines no test_absent"]
    assert check("tests/test_made_up.py::test_runs_it") == []
    other = check("tests/test_made_up.py::test_runs_another_format")
    assert len(other) == 1 and "['data.format=criteo']" in other[0], other
    assert check("tests/test_made_up.py::test_runs_another_format", note="data.format=synthetic, not "
                 "data.format=criteo") == []
    assert check("tests/test_made_up.py::test_runs_another_format", note="data.format=criteo's") == other
    both = check("tests/test_made_up.py::test_runs_nothing", "tests/test_made_up.py::test_runs_another_format")
    assert len(both) == 1  # a line neither test runs whole
    assert "['jaxpar-train']" in check("tests/test_made_up.py::test_runs_nothing")[0]
    assert jaxpar_commands("srun .venv/bin/jaxpar-train 1b  # a GPU's\npip install -e .\n") == [["jaxpar-train", "1b"]]
