"""colab/quickstart.ipynb runs top to bottom in a Jupyter kernel, and is stored executed.

The kernel inherits this process's environment, so it sees the 8 simulated CPU devices
conftest sets up (``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=8``) and the test run's
tokenizer cache (``XDG_CACHE_HOME``); jaxpar is already installed, so the notebook's
install cell does nothing. The tests execute a copy in memory and never write the file;
``colab/execute.py`` runs it and saves it with its outputs (loss plot included), which
``test_stored_notebook_has_outputs`` checks from the JSON alone, in the fast tier.
"""

import base64
import importlib.util
import math
import pathlib
import re

import pytest


import nbformat
import nbclient
import ipykernel  # noqa: F401  (the notebook kernel)

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "colab" / "quickstart.ipynb"
PLOT_CELL = "loss-plot"  # the id of the cell that draws the training loss
NOTEBOOK_STEPS, STEPS = 150, 75  # the notebook trains 150 steps; the test's copy the first 75


def _text(cell) -> str:
    """Everything a code cell printed (streams and plain-text results)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def _plot_cell(nb):
    [cell] = [c for c in nb.cells if c.get("id") == PLOT_CELL]
    return cell


def test_stored_notebook_has_outputs():
    """The committed notebook is stored executed (GitHub and Colab show what it prints and
    the loss plot before anyone runs it), cleanly: in order, no errors, no progress-bar
    redraws or machine paths, small. `python colab/execute.py` rewrites it so."""
    assert NOTEBOOK.stat().st_size < 100_000  # 43 KB when written, the plot's PNG most of it
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "JAXPAR_SOURCE = " in code[0].source  # the one place the package source is set
    assert "git clone" not in code[0].source

    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))  # run top to bottom
    assert all(c.outputs for c in code), [c.id for c in code if not c.outputs]
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(_text(c) for c in code)
    assert "\r" not in text  # a progress bar keeps its last state only
    assert not re.search(r"(?<![\w.])/(tmp|home|root|Users|work|content)/", text), text
    assert re.search(r"final loss [\d.]+ after \d+ steps", text), text

    plot = _plot_cell(nb).outputs
    [png] = [o.data["image/png"] for o in plot if "image/png" in o.get("data", {})]
    png = base64.b64decode(png)
    assert png.startswith(b"\x89PNG") and len(png) < 40_000


@pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it
def test_install_source_is_the_checkout_else_pypi(tmp_path, monkeypatch, capsys):
    """The install cell's JAXPAR_SOURCE: $JAXPAR_SOURCE, else the jaxpar checkout around
    the kernel's working directory (the notebook's folder in Jupyter), else PyPI's name."""
    cell = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"][0]
    monkeypatch.delenv("JAXPAR_SOURCE", raising=False)
    monkeypatch.chdir(NOTEBOOK.parent)
    namespace = {}
    exec(cell.source, namespace)  # jaxpar is importable here: it installs nothing
    assert "jaxpar is already installed" in capsys.readouterr().out
    assert namespace["JAXPAR_SOURCE"] == str(NOTEBOOK.parents[1])
    source = namespace["jaxpar_source"]

    (tmp_path / "pyproject.toml").write_text('[project]\nname = "not-jaxpar"\n')
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # Colab's /content: no checkout around it
    assert source() == "jaxpar"
    monkeypatch.setenv("JAXPAR_SOURCE", "git+https://example.org/fork/jaxpar")
    assert source() == "git+https://example.org/fork/jaxpar"


def _bar_module() -> str:
    """The progress bar's module the trainer should take in a kernel: tqdm.auto's widget
    where ipywidgets is installed, else the text bar."""
    try:
        import ipywidgets  # noqa: F401
        return "tqdm.auto"
    except ImportError:
        return "tqdm.std"


@pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    """The notebook, every cell in order, in a Jupyter kernel. The copy trains STEPS
    steps, not the notebook's 150: the run's cost is its steps, every line still runs,
    and 75 steps learn what the test asks with room (final loss 4.95 where 5.24 passes;
    50 steps gave 5.23). A cell added at the end checks the progress bar: in a kernel
    without ipywidgets tqdm.auto warns "IProgress not found" when imported, so the
    trainer takes the text bar there (the widget when it can), and nothing the notebook
    printed, its training included, has the warning."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's run dir lands under tmp_path
    nb = nbformat.read(NOTEBOOK, as_version=4)
    [train_cell] = [c for c in nb.cells if f'"steps={NOTEBOOK_STEPS}"' in c.source]
    train_cell.source = train_cell.source.replace(f'"steps={NOTEBOOK_STEPS}"', f'"steps={STEPS}"')
    nb.cells.append(nbformat.v4.new_code_cell(
        "import jaxpar.train.stepping as stepping\nprint('bar from', stepping.tqdm.__module__)"))
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    out = "\n".join(_text(c) for c in code)
    assert "IProgress" not in out, out  # tqdm's widget warning: the trainer's bar is text here
    assert f"bar from {_bar_module()}" in _text(code[-1]), _text(code[-1])

    assert "jaxpar is already installed" in out
    assert "8 cpu device(s)" in out and "'fsdp': 8" in out
    assert re.search(r"spec P(artitionSpec)?\(.*'fsdp'", out), out  # parameters split over fsdp

    final = re.search(r"final loss ([\d.]+) after (\d+) steps \(untrained: ln\((\d+)\)", out)
    assert final, out
    loss, steps, vocab = float(final.group(1)), int(final.group(2)), int(final.group(3))
    assert steps == STEPS
    assert loss < math.log(vocab) - 1.0  # it learned something

    generated = re.search(r"generated (\d+) tokens:\n(def main\(.*)", out, re.S)
    assert generated, out
    assert int(generated.group(1)) > 0 and len(generated.group(2).strip()) > len("def main(")
    assert list(tmp_path.glob(f"jaxpar-quickstart-*/run/checkpoints/{steps}"))

    plot = _plot_cell(nb)
    pngs = [o for o in plot.outputs if "image/png" in o.get("data", {})]
    if importlib.util.find_spec("matplotlib"):  # on Colab; the kernel is this interpreter
        assert len(pngs) == 1, plot.outputs
    else:  # the cell says so instead of failing
        assert not pngs and "no loss plot: matplotlib is not installed" in _text(plot)
