"""Runs colab/quickstart.ipynb top to bottom and saves it with its outputs.

    .venv/bin/python colab/execute.py             # rewrites colab/quickstart.ipynb
    .venv/bin/python colab/execute.py OUT.ipynb   # or writes the executed copy elsewhere

The kernel (``python3``: this interpreter, with jaxpar installed) starts in colab/, as
Jupyter would, with ``JAXPAR_SOURCE`` set to this checkout. It runs on CPU whatever
accelerator this machine has (the saved outputs are the 8 simulated devices') and with an
empty tokenizer cache (they show a first run). What is saved is kept small and free of
this machine's paths: a progress bar keeps only its last state (what follows its last
carriage return), nbclient's per-cell timestamps are dropped, the temporary directory,
the checkout and the home directory are replaced by ``$TMPDIR``, ``.`` and ``~``, and
the script refuses to save outputs that still name one of them.
Needs nbclient, nbformat, ipykernel (the ``test`` extra) and matplotlib for the loss plot.
"""

import os
import pathlib
import sys
import tempfile

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "colab" / "quickstart.ipynb"


def clean_text(text: str) -> str:
    """What a terminal shows: each line up to a carriage return is overwritten by the
    rest (tqdm redraws its bar that way)."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def clean(nb, *, paths: dict[str, str]) -> None:
    """Strips what varies between machines and runs without meaning: timestamps, the
    kernel's version details, absolute paths (``paths`` maps each to its stand-in)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":  # one output per stream, as Jupyter shows it
            merged = []
            for out in cell.outputs:
                if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
                        and merged[-1].name == out.name):
                    merged[-1].text += out.text
                else:
                    merged.append(out)
            cell.outputs = merged
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                out.text = clean_text(out.text)
            for old, new in paths.items():
                if out.output_type == "stream":
                    out.text = out.text.replace(old, new)
                elif "data" in out and "text/plain" in out.data:
                    out.data["text/plain"] = out.data["text/plain"].replace(old, new)
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs
                            if not (o.output_type == "stream" and not o.text.strip())]
    nb.metadata["language_info"] = {"name": "python"}  # as Colab saves it
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}


def main(out: pathlib.Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    with tempfile.TemporaryDirectory(prefix="jaxpar-notebook-") as tmp:
        env = {"JAX_PLATFORMS": "cpu", "JAXPAR_SOURCE": str(REPO),
               "XDG_CACHE_HOME": os.path.join(tmp, "cache")}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel inherits this process's environment
        try:
            nbclient.NotebookClient(
                nb, timeout=600, kernel_name="python3", allow_errors=False,
                resources={"metadata": {"path": str(NOTEBOOK.parent)}},  # as Jupyter starts it
            ).execute()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        clean(nb, paths={tmp: "$TMPDIR", str(REPO): ".", str(pathlib.Path.home()): "~"})
    nbformat.validate(nb)
    leaked = [p for p in (str(REPO), tempfile.gettempdir() + "/", str(pathlib.Path.home()))
              if p != "/" and p in nbformat.writes(nb)]
    if leaked:
        sys.exit(f"not saved: the outputs name {leaked}; print relative paths in the notebook")
    nbformat.write(nb, out)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else NOTEBOOK)
