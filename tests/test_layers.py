"""The package's layers hold: import-linter's contracts in pyproject.toml (kernels <-
placement/profiler <- parallel <- ops <- models <- inference <- serving <- train <- cluster <-
commands) checked over the source laid out as it installs; and no web stack below jaxpar-serve's
app."""

import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def installed_layout(into: pathlib.Path) -> None:
    """Copies the sources where ``pip install`` puts them (pyproject's ``package-dir``):
    kernels/, models/ and train/ become jaxpar/kernels, jaxpar/models, jaxpar/train."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, source in sorted(package_dir.items()):  # "jaxpar" before its children
        shutil.copytree(ROOT / source, into / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "configs"))


def test_import_layers(tmp_path):
    installed_layout(tmp_path / "src")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    result = subprocess.run([sys.executable, "-c", lint, "--no-cache", "--config", "pyproject.toml"],
                            cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "src")},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in result.stdout, result.stdout


def test_every_package_is_listed_for_installation(tmp_path):
    """pyproject's ``packages`` names every package of the installed layout: one left out
    imports in an editable install (the tests') and is missing from a wheel."""
    installed_layout(tmp_path / "src")
    found = {".".join(p.parent.relative_to(tmp_path / "src").parts)
             for p in (tmp_path / "src").rglob("__init__.py")}
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert found == listed


@pytest.mark.slow
def test_decoding_and_the_chat_template_import_no_web_stack():
    """fastapi, starlette and uvicorn are jaxpar-serve's app's alone: the engine, decoding
    and the chat template (bench/speculative.py's chat prompts) import with them blocked,
    as on a GPU image that lacks them."""
    code = ("import sys\n"
            "for name in ('fastapi', 'starlette', 'uvicorn'):\n"
            "    sys.modules[name] = None  # importing it raises ImportError\n"
            "import jaxpar.inference.decoding, jaxpar.serving.chat_template, jaxpar.serving.engine\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
