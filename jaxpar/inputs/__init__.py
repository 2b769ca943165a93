"""What a user gives jaxpar, read the same way by every command line.

``InputError``: input that cannot be used (a config key or value, a file, a flag, two
features that do not compose): one line naming the offending value. Every command line
prints it and exits 2, before it writes anything; exit 1 is kept for failures after a
run started. Each reader's own error (``ConfigError``, ``JobsError``, ``HardwareError``,
``ProfileError`` ...) is one of these, so a command catches one type.

``read_yaml``: the one YAML reader of config files, ``JOBS.yaml``, hardware profiles and
device profiles: a missing or unreadable file and invalid YAML are each one line (with
the line YAML names, where it names one), raised as the caller's error type.
"""

from __future__ import annotations

import pathlib

import yaml


class InputError(ValueError):
    """Input that cannot be used: one line naming the value; the command lines exit 2."""


def read_yaml(path: str | pathlib.Path, *, named: str | None = None, error: type[InputError] = InputError,
              nodes: bool = False):
    """The YAML document of the file at ``path`` (with ``nodes``: ``(document, its
    composed node tree)``, whose marks give each entry's line). ``named``: how a line
    names a missing file (default its path, quoted). Raises ``error``."""
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise error(f"{named or repr(str(path))} does not exist")
    try:
        text = path.read_text()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    try:
        document = yaml.safe_load(text)
        root = yaml.compose(text) if nodes else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise error(f"{where}: not valid YAML: {' '.join(str(problem).split())}") from None
    return (document, root) if nodes else document
