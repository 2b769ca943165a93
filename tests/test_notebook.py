"""colab/quickstart.ipynb runs top to bottom in a Jupyter kernel.

The kernel inherits this process's environment, so it sees the 8 simulated CPU devices
conftest sets up (``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=8``); jaxpar is already
installed, so the notebook's install cell does nothing.
"""

import math
import pathlib
import re

import pytest


import nbformat
import nbclient
import ipykernel  # noqa: F401  (the notebook kernel)

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips the file

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "colab" / "quickstart.ipynb"


def _text(cell) -> str:
    """Everything a code cell printed (streams and plain-text results)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def test_stored_notebook_is_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert 'JAXPAR_REPO = "' in code[0].source  # the one place the repository URL lives


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's run dir lands under tmp_path
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    out = "\n".join(_text(c) for c in code)

    assert "jaxpar is already installed" in out
    assert "8 cpu device(s)" in out and "'fsdp': 8" in out
    assert re.search(r"spec P(artitionSpec)?\(.*'fsdp'", out), out  # parameters split over fsdp

    final = re.search(r"final loss ([\d.]+) after (\d+) steps \(untrained: ln\((\d+)\)", out)
    assert final, out
    loss, steps, vocab = float(final.group(1)), int(final.group(2)), int(final.group(3))
    assert loss < math.log(vocab) - 1.0  # it learned something

    generated = re.search(r"generated (\d+) tokens:\n(def main\(.*)", out, re.S)
    assert generated, out
    assert int(generated.group(1)) > 0 and len(generated.group(2).strip()) > len("def main(")
    assert list(tmp_path.glob(f"jaxpar-quickstart-*/run/checkpoints/{steps}"))
