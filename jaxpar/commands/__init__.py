"""The command lines (pyproject.toml's ``[project.scripts]``), one module each:
``train`` (``jaxpar-train``, also ``python -m jaxpar.commands.train``), ``generate``
(``jaxpar-generate``), ``serve`` (``jaxpar-serve``), ``plan`` (``jaxpar-plan``) and
``cluster`` (``jaxpar-cluster``); ``common`` holds the argument parser and flags they
share. They sit in the top layer, above ``jaxpar.train`` and ``jaxpar.cluster`` whose
work they start, so the trainer itself holds training only and imports no command.
The package imports nothing itself: a command loads only what it runs.
"""
