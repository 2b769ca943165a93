"""The argument parser of every jaxpar command (``jaxpar-train``, ``jaxpar-generate``, and
any later one: tests/test_cli.py holds each script of pyproject.toml's
``[project.scripts]`` to it) and the compilation-cache flags they share.
(``file_in_the_way``, which a run checks its directories with too, is
``jaxpar.train.data``'s.)"""

from __future__ import annotations

import argparse
import os
import pathlib

import jax


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


def add_compile_cache_flags(parser: argparse.ArgumentParser, *, cache_dir: bool) -> None:
    """``--no-compile-cache``, which every command takes, and with ``cache_dir`` the
    ``--cache-dir DIR`` of a command without a config (``jaxpar-train`` has its
    ``cache_dir`` key); ``compile_cache_from_args`` applies them."""
    if cache_dir:
        parser.add_argument("--cache-dir", type=pathlib.Path, metavar="DIR",
                            help="where compiled programs are kept for the next start (DIR/xla; default: "
                                 "$XDG_CACHE_HOME/jaxpar, else ~/.cache/jaxpar, as jaxpar-train's cache_dir)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not keep compiled programs in JAX's persistent compilation cache "
                             "(CACHE_DIR/xla) for the next start")


def compile_cache_from_args(args, parser: CommandParser) -> None:
    """``use_compile_cache`` as ``--cache-dir`` and ``--no-compile-cache`` say; a
    ``--cache-dir`` that is (or lies under) a file is ``parser.error``."""
    # Here, not at the top (nor cache_dir_of below): jaxpar.train.data loads tokenizers
    # and the GGUF reader (0.2 s), which jaxpar-train's --help and jaxpar-cluster never need.
    from jaxpar.train.data import file_in_the_way

    if args.cache_dir is not None and (file := file_in_the_way(args.cache_dir)):
        parser.error(f"--cache-dir {args.cache_dir}: {file} is a file, not a directory")
    use_compile_cache(args.cache_dir, not args.no_compile_cache)


def use_compile_cache(cache_dir: str | os.PathLike | None, enabled: bool = True) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir/xla``
    (``jaxpar.train.data.cache_dir_of``), so a second start of a command loads the
    programs the first compiled instead of compiling them again. Entries are keyed as JAX
    keys them (the program, its shapes and shardings, the compile options, the JAX and
    XLA versions and the devices), so a changed model, mesh or release compiles anew and
    never reads a stale one. Every program is kept, however quick to compile (JAX's own
    default skips those under a second): a server's many small bucket programs are most
    of its start.

    ``JAX_COMPILATION_CACHE_DIR`` (or ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``) in
    the environment wins over both. ``enabled=False`` (``--no-compile-cache``) turns
    the cache off. Must run before the first compile."""
    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if not jax.config.jax_compilation_cache_dir:
        from jaxpar.train.data import cache_dir_of

        jax.config.update("jax_compilation_cache_dir", str(cache_dir_of(cache_dir) / "xla"))
