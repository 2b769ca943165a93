"""Self-distilled GliDe training rows (``glide.self_distill=true``): the target's own
greedy continuations of prompts, not the corpus' text.

A draft is judged by how often it proposes what the *target* would emit next while
decoding, and what a target emits greedily is not what its corpus says: a small model
repeats itself, settles into loops and favours its own phrasings, all of which a draft
can learn and none of which the corpus shows it. Medusa-2 ("self-distillation", Cai et
al., 2024) and EAGLE (Li et al., 2024) regenerate their training data with the target
for that reason. Here every document of a split is one prompt, its first
``glide.prompt_tokens`` tokens (all of it when shorter), and the target continues it
greedily to ``seq_len + 1`` tokens: one training row per document, the prompt's tokens
and then the target's, one segment at positions ``0..seq_len`` (as decoding sees them).

The rows are what ``jaxpar.inference.decoding.speculative_generate(method="ar")``
gives, in batches of ``glide.generate_batch`` prompts of similar lengths (each batch
generating what its shortest prompt needs, rounded up to ``LENGTH_STEP`` tokens so a
run compiles few programs). Generating is the dear part (about 120 tokens/s on the
2-core CPU for SmolLM2-135M at batch 64), so the rows are stored in ``cache_dir``, by
prompt, for each target (its parameters), tokenizer and ``seq_len``, a file per batch:
an interrupted build keeps its finished batches, a corpus that grows generates only its
new prompts, and a second run, or a teacher cache built over the rows
(``glide.teacher_cache``), reads them without generating.

A corpus for drafts that serve chat: documents that are user turns already rendered
through the target's chat template (``bench/glide_prompts.py`` writes code, chat and
prose prompts from the standard library so).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import time

import jax
import numpy as np
import tokenizers
from tqdm import tqdm

from jaxpar.inference.decoding import speculative_generate
from jaxpar.train import data as data_lib
from jaxpar.train.config import Config, ConfigError
from jaxpar.train.data import PackedRows, write_atomic
from jaxpar.train.teacher_cache import params_fingerprint

log = logging.getLogger(__name__)

FORMAT = 1
# Each batch generates its shortest prompt's need rounded up to a multiple of this many
# tokens: at most seq_len / LENGTH_STEP loop programs per split.
LENGTH_STEP = 16
# Characters of a document tokenized for its prompt: byte-level BPE tokens are rarely
# longer than 16 characters, and the cut's last few tokens are never kept (first_tokens).
_CHARS_PER_TOKEN = 16


def first_tokens(tokenizer: tokenizers.Tokenizer, text: str, n: int) -> np.ndarray:
    """The first ``n`` tokens of ``text`` (all of them when fewer), int32, without
    tokenizing the whole document: its first ``16 n`` characters are, and the tokens
    near that cut (which may merge across it) are never among those kept."""
    chars = _CHARS_PER_TOKEN * (n + 8)
    ids = tokenizer.encode(text[:chars]).ids
    if len(text) > chars and len(ids) < n + 8:  # unusually long tokens: take the whole text
        ids = tokenizer.encode(text).ids
    return np.asarray(ids[:n], np.int32)


def prompts(cfg: Config, tokenizer: tokenizers.Tokenizer, split: str, count: int | None = None) -> list[np.ndarray]:
    """The prompts of ``split``: each document's ``first_tokens`` (``glide.prompt_tokens``;
    empty ones dropped), in corpus order; ``count`` of them spread evenly over the split
    (prompt ``i * n // count``), or all.

    Raises:
      ValueError: ``count`` exceeds the split's prompts.
    """
    docs = data_lib.split_documents(cfg.data, split)
    found = [p for p in (first_tokens(tokenizer, d.text, cfg.glide.prompt_tokens) for d in docs) if len(p)]
    if count is None:
        return found
    if count > len(found):
        key = "glide.train_rows" if split == "train" else "eval.batches x batch_size"
        raise ValueError(f"{key}={count} exceeds the {split} split's {len(found)} documents (one "
                         f"self-distilled row each with glide.self_distill)")
    return [found[i * len(found) // count] for i in range(count)]


def _batches(lengths: np.ndarray, batch: int) -> list[np.ndarray]:
    """Prompt indices in batches of ``batch`` (the last padded with its own first
    index), by length, longest first: a batch's prompts need similar continuations."""
    order = np.argsort(-lengths, kind="stable")
    out = []
    for start in range(0, len(order), batch):
        part = order[start:start + batch]
        out.append(np.concatenate([part, np.full(batch - len(part), part[0])]))
    return out


def _new_tokens(shortest: int, width: int) -> int:
    """Tokens a batch generates: ``width - shortest`` rounded up to ``LENGTH_STEP``."""
    need = width - shortest
    return min(-(-need // LENGTH_STEP) * LENGTH_STEP, width - 1)


def _prompt_key(prompt: np.ndarray) -> bytes:
    return hashlib.sha256(np.asarray(prompt, "<i4").tobytes()).digest()


def store_directory(cache_dir: str | os.PathLike, fingerprint: str, tokenizer: tokenizers.Tokenizer,
                    width: int) -> pathlib.Path:
    """Where the rows of one target, tokenizer and row width are stored:
    ``cache_dir/generated-<key>``, whatever the prompts (a row is found by its prompt)."""
    h = hashlib.sha256(f"self-distill {FORMAT} {fingerprint} {width} {LENGTH_STEP}".encode())
    h.update(hashlib.sha256(tokenizer.to_str().encode("utf-8")).digest())
    return pathlib.Path(cache_dir, f"generated-{h.hexdigest()[:16]}")


def _stored(directory: pathlib.Path, width: int) -> dict[bytes, np.ndarray]:
    """Every stored row by its prompt's key (a file that does not load whole, an
    interrupted write, is skipped)."""
    rows = {}
    for path in sorted(directory.glob("rows-*.npz")):
        try:
            with np.load(path) as f:
                tokens, lengths = f["tokens"], f["prompt_lengths"]
        except (OSError, ValueError, KeyError):
            continue
        if tokens.ndim == 2 and tokens.shape[1] == width and len(lengths) == len(tokens):
            rows.update((_prompt_key(row[:n]), row) for row, n in zip(tokens, lengths))
    return rows


def generated_rows(cfg: Config, target, tokenizer: tokenizers.Tokenizer, prompt_list: list[np.ndarray],
                   cache_dir: str | os.PathLike, fingerprint: str, *, progress: bool = False) -> PackedRows:
    """One row of ``seq_len + 1`` tokens per prompt, in ``prompt_list``'s order: the
    prompt, then ``target``'s greedy continuation (``speculative_generate``, method
    ``ar``; end tokens do not stop it, as a draft must follow whatever the target emits).

    Rows are stored by prompt (under ``store_directory``, a file per generated batch,
    ``rows-<key of its prompts>.npz``, holding the rows and their prompts' lengths):
    only prompts with no stored row are generated, so an interrupted build loses at
    most a batch and a corpus that grows generates only its new prompts.

    Args:
      target: the target ``Transformer`` (its parameters' sha256 is ``fingerprint``).
      prompt_list: int32 ``[P_i]`` prompts, ``1 <= P_i <= seq_len``.
      cache_dir: the store's parent directory.
      progress: a progress bar over the batches generated (on a terminal).

    Raises:
      ConfigError: prompts to generate in a run of several processes.
    """
    width = cfg.seq_len + 1
    directory = store_directory(cache_dir, fingerprint, tokenizer, width)
    stored = _stored(directory, width)
    keys = [_prompt_key(p) for p in prompt_list]
    missing = sorted({k: i for i, k in enumerate(keys) if k not in stored}.values())  # each prompt once
    if missing and jax.process_count() > 1:
        raise ConfigError(f"generating glide.self_distill rows runs in one process ({len(missing)} prompts "
                          "to continue); generate them with a one-process run first")
    batch = cfg.glide.generate_batch
    batches = _batches(np.asarray([len(prompt_list[i]) for i in missing]), batch) if missing else []
    bar = tqdm(total=len(batches), disable=None if progress and batches else True, desc="self-distill",
               unit="batch", dynamic_ncols=True, leave=False)
    began = time.perf_counter()
    for n, index in enumerate(batches):
        chunk = [prompt_list[missing[i]] for i in index]
        new = _new_tokens(min(len(p) for p in chunk), width)
        out = speculative_generate(target, chunk, method="ar", max_new_tokens=new)
        rows = np.stack([np.concatenate([p, t])[:width] for p, t in zip(chunk, out.tokens)])
        lengths = np.asarray([len(p) for p in chunk], np.int32)
        name = hashlib.sha256(b"".join(keys[missing[i]] for i in index)).hexdigest()[:16]
        write_atomic(directory / f"rows-{name}.npz",
                     lambda f, r=rows, n=lengths: np.savez(f, tokens=r, prompt_lengths=n))
        stored.update(zip((keys[missing[i]] for i in index), rows))
        bar.update(1)
        log.info("self-distilled rows: batch %d/%d (%d prompts, %d new tokens each) in %.0f s",
                 n + 1, len(batches), batch, new, time.perf_counter() - began)
    bar.close()
    tokens = np.stack([stored[k] for k in keys]).astype(np.int32) if keys else np.zeros((0, width), np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape).copy()
    return PackedRows(tokens, np.ones_like(tokens), positions)


def load_rows(cfg: Config, target, tokenizer: tokenizers.Tokenizer, cache_dir: str | os.PathLike, *,
              progress: bool = False) -> tuple[PackedRows, PackedRows]:
    """``(train rows, validation rows)`` of a ``glide.self_distill`` run: one generated
    row per training prompt (``glide.train_rows`` of them, or every document's), and per
    validation prompt the evaluation reads (``eval.batches x batch_size``; none without
    evaluation)."""
    fingerprint = params_fingerprint(target)
    train_prompts = prompts(cfg, tokenizer, "train", cfg.glide.train_rows)
    val_count = cfg.eval.batches * cfg.batch_size if cfg.eval.every else 0
    val_prompts = prompts(cfg, tokenizer, "validation", val_count) if val_count else []
    train = generated_rows(cfg, target, tokenizer, train_prompts, cache_dir, fingerprint, progress=progress)
    if not val_prompts:
        empty = np.zeros((0, cfg.seq_len + 1), np.int32)
        return train, PackedRows(empty, empty, empty)
    return train, generated_rows(cfg, target, tokenizer, val_prompts, cache_dir, fingerprint, progress=progress)

