"""The argument parser of every jaxpar command (``jaxpar-train``, ``jaxpar-generate``, and
any later one: tests/test_cli.py holds each script of pyproject.toml's
``[project.scripts]`` to it)."""

from __future__ import annotations

import argparse


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes flags anywhere among the positionals
    (``jaxpar-train tiny --no-progress steps=3``, where plain ``parse_args`` stops the
    positionals at the first flag) and reports a bad argument as the commands report
    their own checks: one line, ``PROG: error: MESSAGE``, exit code 2."""

    def parse_args(self, args=None, namespace=None):
        # parse_intermixed_args calls parse_known_args, never this, so no recursion.
        return self.parse_intermixed_args(args, namespace)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
