"""The engine's settings in one place: ``ServingConfig``. ``Engine(model, config, ...)``
reads it (keyword arguments override its fields), and ``jaxpar-serve``'s flags are made
from its fields (``add_flags``, ``from_args``): one list of defaults and help texts.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxpar.inference.token_tree import DEFAULT_BINS

MAX_NUM_BATCHED_TOKENS = 256
MAX_BATCH = 256
CPU_KV_MEMORY = 2 ** 30


def _setting(default, help: str, **flag):
    """A field with its command-line help (``%(default)s`` as argparse writes it)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """How an ``Engine`` batches, caches and decodes (each field's help says what it does;
    ``jaxpar.serving.engine.Engine`` the details)."""

    max_num_batched_tokens: int = _setting(
        MAX_NUM_BATCHED_TOKENS, "the step's token budget: decode rows and prompt chunks (%(default)s); larger "
        "prefills faster, smaller keeps each step, so each running sequence's next token, quicker")
    max_batch: int | None = _setting(
        None, f"the most sequences running at once (default: what the page pool and the token budget allow, at "
        f"most {MAX_BATCH})")
    max_context: int | None = _setting(
        None, "the longest prompt + max_tokens a request may ask for (default: the model's context); a limit "
        "only: the compiled programs are the same whatever it is", metavar="TOKENS")
    page_size: int = _setting(16, "tokens per KV cache page (%(default)s)")
    kv_pages: int | None = _setting(None, "pages in the KV cache, the null page included (default: from "
                                    "--kv-memory)", cli=False)
    kv_memory: int | None = _setting(
        None, f"bytes of KV cache pages per device (default: 90%% of a GPU's free memory after the weights; "
        f"{CPU_KV_MEMORY >> 20} MiB on a CPU; at most what --max-batch sequences of the whole context need)",
        metavar="BYTES")
    prefix_caching: bool = _setting(
        True, "reuse the KV pages of a cached prompt prefix (full pages keyed by their tokens; freed pages stay "
        "cached until needed)")
    max_prefills: int = _setting(4, "the most prompts with a chunk in one step (%(default)s)")
    batching: str = _setting("continuous", "static: admit only into an empty batch, the baseline "
                             "bench/serve.py compares with (%(default)s)", choices=("continuous", "static"))
    method: str | None = _setting(
        None, "speculative decoding method with --draft (default: glide for a GliDe draft, else speculative; "
        "cape: token trees for greedy requests)", choices=("speculative", "glide", "cape"))
    gamma: int = _setting(4, "draft tokens per speculative round (%(default)s)")
    bins: tuple[int, ...] = _setting(DEFAULT_BINS, "cape: the tree's widths by the draft's confidence",
                                     cli=False)

    def check(self) -> None:
        """ValueError, one line naming the bad value."""
        for name in ("max_num_batched_tokens", "max_batch", "page_size", "max_prefills", "gamma", "kv_pages",
                     "kv_memory", "max_context"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching={self.batching!r} must be 'continuous' or 'static'")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``ServingConfig``'s fields as ``parser``'s flags (``--max-num-batched-tokens``,
    ``--prefix-caching/--no-prefix-caching``, ...), their defaults and help its own."""
    for field in dataclasses.fields(ServingConfig):
        meta = dict(field.metadata)
        if not meta.pop("cli", True):
            continue
        kind = {"int": int, "int | None": int, "str": str, "str | None": str, "bool": bool}[field.type]
        if kind is bool:
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=field.default,
                                help=meta["help"] + " (on by default)" * field.default)
        else:
            if kind is int:
                meta.setdefault("metavar", "N")
            parser.add_argument(_flag(field.name), type=kind, default=field.default, **meta)


def from_args(args: argparse.Namespace) -> ServingConfig:
    """The ``ServingConfig`` of ``add_flags``' parsed flags (checked)."""
    config = ServingConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServingConfig)
                              if hasattr(args, f.name)})
    config.check()
    return config
