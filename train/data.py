"""The training data pipeline: text files -> byte-level BPE tokens -> packed rows -> batches.

  corpus(cfg)            every Document (name, text) of the configured source, sorted
  documents(cfg, split)  the texts of one split; the split is decided per document by
                         a hash of its name, so it is stable across machines and runs
  load_tokenizer         a given tokenizer.json, or a byte-level BPE trained once on
                         the train split and cached
  pack                   documents + EOS, cut into rows of ``seq_len + 1`` tokens with
                         per-row ``segment_ids`` and ``positions`` (PackedRows)
  packed_rows            tokenize + pack one split, cached on disk
  eval_batches           the first n validation batches, unshuffled (their rows:
                         eval_rows)
  batch_of_rows          the batch of given rows (what a teacher cache indexes by)

Batches are dicts of int32 ``[B, T]`` numpy arrays (B = this process's share of the
global batch, T = seq_len): ``inputs``, ``targets``, ``positions``, ``segment_ids``,
``mask``, the keys ``jaxpar.train.step.loss_fn`` reads. The shuffled training batches
are ``jaxpar.train.loader.Loader``'s.

Caches live in a caller-given directory (the trainer's ``cache_dir``, by default the
per-user ``default_cache_dir()``) and are keyed by content (see ``_fingerprint``):
``tokenizer-<key>.json`` and ``packed-<key>-<split>-<seq_len>.npz``. A changed file, a
different ``max_files``, ``val_fraction`` or ``text_field``, another vocabulary size,
tokenizer or ``seq_len``, or another ``tokenizers`` release gives another key, so stale
entries are never read (they are simply left behind) and runs in any run dir share the
entries that match. Every cache file is written to a temporary name and moved into
place with ``os.replace``, so processes that race to build the same entry (they build
identical bytes) never see a half-written file.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import pathlib
import sysconfig
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

import jax
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxpar.models.gguf import gguf_tokenizer

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
SPLITS = ("train", "validation")
# Bump when the meaning of a cache file changes (tokenizer recipe, packing layout).
_CACHE_VERSION = 1
# A file with a NUL byte in its first 8 KiB is taken for binary and skipped (git's test).
_BINARY_SNIFF = 8192
# Documents per encode_batch call: bounds the memory of HF Encoding objects.
_ENCODE_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    # None: the running interpreter's standard library source (every *.py under
    # sysconfig's "stdlib" path, recursively, skipping site-packages). Otherwise one of
    #   a directory: every regular file under it, recursively, except hidden (dot)
    #     files and directories and binary-looking files;
    #   a glob (contains * ? or [; ** recurses): the regular files it matches;
    #   a file.
    # Files ending in .jsonl hold one JSON object per line, one document per line;
    # every other file is one document, decoded as UTF-8 with errors="replace".
    path: str | None = None
    text_field: str = "text"  # the JSONL field holding a document's text
    # A local tokenizer.json; None: train a byte-level BPE of model.vocab_size tokens
    # (EOS included), so the embedding has a row for every token and no more.
    tokenizer: str | None = None
    # Share of documents held out for validation, decided by crc32 of the document's
    # name (its path relative to the corpus root; "file.jsonl:LINE" for JSONL lines).
    val_fraction: float = 0.05
    max_files: int | None = None  # only the first N files after sorting (quick runs)
    # Speed-proportional batches across unequal processes (HetSeq, jaxpar.train.weighted):
    # one positive weight per process, each process's share of every global batch; or
    # "auto": measured on a few timed passes at the start, and again every
    # rebalance_every steps when set. None: equal slices.
    batch_weights: tuple[float, ...] | Literal["auto"] | None = None
    rebalance_every: int | None = None
    # What the data is: "text" (a language model's corpus, above), or, with task: dlrm,
    # "criteo" (Criteo's TSV at path: label, 13 integer and 26 hexadecimal columns; plain
    # or gzip) or "synthetic" (Zipf-distributed ids with exponent zipf_alpha and a planted
    # signal: jaxpar.train.recsys_data).
    format: Literal["text", "criteo", "synthetic"] = "text"
    zipf_alpha: float = 1.05

    def __post_init__(self):
        for name in ("path", "tokenizer"):  # "~/corpus" as a user types it
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.path.expanduser(getattr(self, name)))
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.max_files is not None and self.max_files < 1:
            raise ValueError(f"data.max_files={self.max_files} must be >= 1 or None")
        if not self.text_field:
            raise ValueError("data.text_field must be a non-empty field name")
        if isinstance(self.batch_weights, tuple) and any(not w > 0 for w in self.batch_weights):
            raise ValueError(f"data.batch_weights={list(self.batch_weights)}: every weight must be positive")
        if self.rebalance_every is not None and self.rebalance_every < 1:
            raise ValueError(f"data.rebalance_every={self.rebalance_every} must be >= 1 or unset")
        if self.rebalance_every is not None and self.batch_weights != "auto":
            raise ValueError(f"data.rebalance_every={self.rebalance_every} re-measures data.batch_weights=auto; "
                             f"data.batch_weights is {self.batch_weights!r}")
        if not self.zipf_alpha > 0:
            raise ValueError(f"data.zipf_alpha={self.zipf_alpha} must be positive")


# Corpus --------------------------------------------------------------------------------


class Document(NamedTuple):
    name: str  # stable id: path relative to the corpus root, or "file.jsonl:LINE"
    text: str


def _source_files(cfg: DataConfig) -> tuple[str, list[tuple[str, str]]]:
    """``(root, [(name, path), ...])``: the corpus root and its files, sorted by name
    (the path relative to the root, with "/"), capped at ``cfg.max_files``."""
    if cfg.path is None:
        root = sysconfig.get_paths()["stdlib"]
        files = _walk(root, skip_dirs=("site-packages", "__pycache__"), suffix=".py")
        where = f"the standard library at {root}"
    elif glob.has_magic(cfg.path):
        root = _glob_root(cfg.path)
        files = [(_rel(p, root), p) for p in glob.glob(cfg.path, recursive=True) if os.path.isfile(p)]
        where = f"glob {cfg.path!r}"
    elif os.path.isdir(cfg.path):
        root = cfg.path
        files = _walk(root, skip_hidden=True)
        where = f"directory {cfg.path}"
    elif os.path.isfile(cfg.path):
        root, where = os.path.dirname(cfg.path) or ".", cfg.path
        files = [(_rel(cfg.path, root), cfg.path)]
    else:
        raise ValueError(f"data.path={cfg.path!r}: no such file or directory")
    if not files:
        raise ValueError(f"no files matched {where}")
    return root, sorted(files)[: cfg.max_files]


def _walk(root: str, *, skip_dirs=(), skip_hidden=False, suffix="") -> list[tuple[str, str]]:
    """``(name, path)`` of the regular files under ``root`` ending in ``suffix``, as
    ``os.walk`` finds them (directory symlinks not followed, unreadable directories
    skipped) but from ``os.scandir``'s entries: no ``stat`` a file and no ``relpath`` a
    name (the standard library's 50,000 files in 5 ms instead of 40, three times a run)."""
    out = []

    def visit(directory: str, prefix: str) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return
        for entry in entries:
            if skip_hidden and entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in skip_dirs:
                    visit(entry.path, f"{prefix}{entry.name}/")
            elif entry.name.endswith(suffix) and entry.is_file():
                out.append((prefix + entry.name, entry.path))

    visit(root, "")
    return out


def _glob_root(pattern: str) -> str:
    """The directory part of ``pattern`` before its first wildcard."""
    parts = pathlib.Path(pattern).parts
    fixed = parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]
    return os.path.join(*fixed) if fixed else "."


def _rel(path: str, root: str) -> str:
    return pathlib.PurePath(os.path.relpath(path, root)).as_posix()


def corpus(cfg: DataConfig) -> list[Document]:
    """Every non-empty document of the configured source, in sorted file order."""
    root, files = _source_files(cfg)
    docs = []
    for name, path in files:
        if name.endswith(".jsonl"):
            docs.extend(_jsonl(path, name, cfg.text_field))
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:_BINARY_SNIFF] or not data:
            continue
        docs.append(Document(name, data.decode("utf-8", errors="replace")))
    if not docs:
        raise ValueError(f"empty corpus: {len(files)} file(s) under {root}, no non-empty text")
    return docs


def _jsonl(path: str, name: str, field: str) -> Iterator[Document]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or field not in obj:
                raise ValueError(f"{path}:{line_no}: no {field!r} field (set data.text_field)")
            text = obj[field]
            if not isinstance(text, str):
                kind = type(text).__name__
                raise ValueError(f"{path}:{line_no}: {field!r} is {kind}, not a string")
            if text:
                # JSON may carry lone surrogates ("\ud800"), which tokenizers cannot take.
                text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
                yield Document(f"{name}:{line_no}", text)


def split_of(name: str, val_fraction: float) -> str:
    """``"validation"`` if crc32 of ``name`` falls in the lowest ``val_fraction`` of its
    range, else ``"train"``: a pure function of the name, the same on every machine."""
    return "validation" if zlib.crc32(name.encode("utf-8")) < val_fraction * 2**32 else "train"


def split_documents(cfg: DataConfig, split: str) -> list[Document]:
    """The documents (name and text) of ``split``, in corpus order."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    docs = corpus(cfg)
    chosen = [d for d in docs if split_of(d.name, cfg.val_fraction) == split]
    if not chosen:
        raise ValueError(
            f"the {split} split is empty: none of {len(docs)} documents hashed into it with "
            f"data.val_fraction={cfg.val_fraction}; change val_fraction or add documents"
        )
    return chosen


def documents(cfg: DataConfig, split: str) -> list[str]:
    """The texts of ``split`` ("train" or "validation"), in corpus order."""
    return [d.text for d in split_documents(cfg, split)]


def default_cache_dir() -> pathlib.Path:
    """Where tokenizers and packed rows are cached when no ``cache_dir`` is given:
    ``$XDG_CACHE_HOME/jaxpar``, else ``~/.cache/jaxpar`` (as pip and Hugging Face do;
    a relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec says)."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):
        root = os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root, "jaxpar")


def cache_dir_of(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """Where a ``cache_dir`` setting (``jaxpar-train``'s key, the other commands'
    ``--cache-dir``) puts the caches: it, ``~`` expanded; unset, ``default_cache_dir()``."""
    return pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def file_in_the_way(path: str | os.PathLike) -> pathlib.Path | None:
    """The file that keeps ``path`` from being (or becoming) a directory: ``path`` itself,
    or the nearest of its parents that exists; None if there is none. (A run's
    ``run_dir`` and ``cache_dir``, checked before anything is written; the commands'
    ``--cache-dir`` and ``--out``.)"""
    path = pathlib.Path(path).expanduser()
    at = next((p for p in (path, *path.parents) if p.exists()), None)
    return None if at is None or at.is_dir() else at


def _fingerprint(*parts) -> str:
    """A short sha256 of strings, ints and Documents (each length-prefixed, so
    boundaries count): the identity behind every cache key."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Document):
            part = f"{part.name}\0{part.text}"
        data = str(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


# Tokenizer -----------------------------------------------------------------------------


def load_tokenizer(cfg: DataConfig, vocab_size: int, cache_dir: str | os.PathLike) -> tokenizers.Tokenizer:
    """``cfg.tokenizer`` if given (a tokenizer.json, or a .gguf file's tokenizer), else
    the byte-level BPE of the train split with ``vocab_size`` tokens (the model's).

    The trained tokenizer is cached as ``cache_dir/tokenizer-<key>.json`` with key =
    hash(recipe version, the ``tokenizers`` release, vocab_size, EOS, every train
    document's name and text), so it is trained once and later runs load it. Training
    covers the whole train split: the standard library's (~30 MB, ~1,700 files) takes
    ~5-10 s on 2 cores, so no subsampling is needed.
    """
    if cfg.tokenizer is not None:
        if not os.path.isfile(cfg.tokenizer):
            raise ValueError(f"data.tokenizer={cfg.tokenizer!r}: no such file")
        if cfg.tokenizer.endswith(".gguf"):
            return gguf_tokenizer(cfg.tokenizer)
        return tokenizers.Tokenizer.from_file(cfg.tokenizer)
    docs = split_documents(cfg, "train")
    key = _fingerprint("bpe", _CACHE_VERSION, tokenizers.__version__, vocab_size, EOS, *docs)
    path = pathlib.Path(cache_dir, f"tokenizer-{key}.json")
    if path.is_file():
        return tokenizers.Tokenizer.from_file(str(path))
    log.info("training a %d-token BPE on %d documents (once: cached in %s)", vocab_size, len(docs), cache_dir)
    start = time.perf_counter()
    tokenizer = _train_tokenizer([d.text for d in docs], vocab_size)
    log.info("trained a %d-token BPE on %d documents in %.1f s",
             tokenizer.get_vocab_size(), len(docs), time.perf_counter() - start)
    write_atomic(path, lambda f: f.write(tokenizer.to_str().encode("utf-8")))
    return tokenizer


def _train_tokenizer(texts: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE: any text encodes (no unknown token) and decodes back
    exactly. ``EOS`` is the only special token, id 0."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def eos_id(tokenizer: tokenizers.Tokenizer) -> int:
    """The id of ``EOS`` in ``tokenizer``."""
    i = tokenizer.token_to_id(EOS)
    if i is None:
        raise ValueError(f"the tokenizer has no {EOS!r} token; packing ends every document with it")
    return i


# Embedding rows a model may have past its tokenizer's vocabulary: padding the table to
# a multiple of 128 (as Megatron and MaxText do, for tensor-parallel splits and tiles).
VOCAB_PAD = 128


def check_vocab(tokenizer: tokenizers.Tokenizer, model_vocab_size: int) -> None:
    """Raises unless the model's embedding table fits the tokenizer: a row for every token
    id, and no more rows than padding to a multiple of ``VOCAB_PAD`` adds (rows no token
    reads would be trained, stored and projected onto at every step for nothing)."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n > model_vocab_size:
        raise ValueError(f"tokenizer vocab {n} exceeds model.vocab_size {model_vocab_size}")
    padded = -(-n // VOCAB_PAD) * VOCAB_PAD
    if model_vocab_size > padded:
        raise ValueError(f"model.vocab_size={model_vocab_size} but the tokenizer has {n} tokens: "
                         f"{model_vocab_size - n} embedding rows would never be read; set "
                         f"model.vocab_size={n} (or up to {padded}), or use a tokenizer of that size")


def tokenize(tokenizer: tokenizers.Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """int32 token ids ``[len_i]`` of each text, without EOS.

    Text is taken literally: a document that contains the string ``"<|endoftext|>"``
    gets ordinary tokens for it, so EOS ids only ever come from ``pack``. (This flips
    ``tokenizer.encode_special_tokens`` for the duration: not thread-safe.)
    """
    literal = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        out = []
        for i in range(0, len(texts), _ENCODE_CHUNK):
            chunk = list(texts[i : i + _ENCODE_CHUNK])
            encodings = tokenizer.encode_batch_fast(chunk, add_special_tokens=False)
            out.extend(np.asarray(e.ids, np.int32) for e in encodings)
        return out
    finally:
        tokenizer.encode_special_tokens = literal


# Packing -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Documents packed end to end into rows of ``seq_len + 1`` tokens (R rows).

    tokens:      int32 ``[R, seq_len + 1]``; every document is followed by EOS.
    segment_ids: int32 ``[R, seq_len + 1]``; 1-based index of the token's document
                 within its row (a document continued from the previous row is 1).
    positions:   int32 ``[R, seq_len + 1]``; the token's offset from the start of its
                 document's piece in this row: 0 at every document start, and also 0
                 at the start of a row that continues a document.

    Why restart a continued document at 0: positions stay below ``seq_len + 1``, so a
    learned position table of the model's length covers them, and with RoPE nothing
    changes, since a query only sees keys of its own segment, of this row, and RoPE
    scores depend only on position differences.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1


def pack(token_docs: Sequence[np.ndarray], seq_len: int, eos_id: int) -> PackedRows:
    """Appends ``eos_id`` to each document, concatenates them and cuts the stream into
    rows of ``seq_len + 1`` tokens; the incomplete last row is dropped.

    Args:
      token_docs: int token ids ``[len_i]`` per document, in order.
      seq_len: T; rows hold T + 1 tokens so inputs ``row[:-1]`` and targets ``row[1:]``
        are both T long.
      eos_id: the id appended after every document.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    width = seq_len + 1
    lengths = np.array([len(d) + 1 for d in token_docs], np.int64)  # with EOS
    eos = np.array([eos_id], np.int32)
    pieces = [p for d in token_docs for p in (np.asarray(d, np.int32).reshape(-1), eos)]
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    rows = len(stream) // width
    keep = rows * width
    starts = np.cumsum(lengths) - lengths
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)[:keep].reshape(rows, width)
    offset = (np.arange(len(stream)) - np.repeat(starts, lengths))[:keep].reshape(rows, width)
    segment_ids = doc - doc[:, :1] + 1
    positions = np.where(segment_ids == 1, offset - offset[:, :1], offset)
    return PackedRows(
        stream[:keep].reshape(rows, width),
        segment_ids.astype(np.int32),
        positions.astype(np.int32),
    )


def packed_rows(
    cfg: DataConfig,
    tokenizer: tokenizers.Tokenizer,
    seq_len: int,
    split: str,
    cache_dir: str | os.PathLike,
) -> PackedRows:
    """The packed rows of ``split``, from ``cache_dir`` when an earlier run made them.

    Cached as ``packed-<key>-<split>-<seq_len>.npz`` with key = hash(layout version,
    the ``tokenizers`` release, the tokenizer's full JSON, seq_len, every document of
    the split), so the second run reads the corpus (to hash it; ~0.1 s for the standard
    library) but does not tokenize.
    """
    docs = split_documents(cfg, split)
    key = _fingerprint("packed", _CACHE_VERSION, tokenizers.__version__, tokenizer.to_str(),
                       seq_len, *docs)
    path = pathlib.Path(cache_dir, f"packed-{key}-{split}-{seq_len}.npz")
    if path.is_file():
        with np.load(path) as f:
            return PackedRows(f["tokens"], f["segment_ids"], f["positions"])
    log.info("tokenizing and packing %d %s documents into rows of %d tokens (once: cached in %s)",
             len(docs), split, seq_len + 1, cache_dir)
    start = time.perf_counter()
    rows = pack(tokenize(tokenizer, [d.text for d in docs]), seq_len, eos_id(tokenizer))
    log.info("tokenized and packed %d %s documents into %d rows in %.1f s",
             len(docs), split, len(rows), time.perf_counter() - start)
    write_atomic(path, lambda f: np.savez(f, **dataclasses.asdict(rows)))
    return rows


def write_atomic(path: pathlib.Path, write) -> None:
    """Calls ``write(binary_file)`` on a temporary file beside ``path``, then renames it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its files are 0600 whatever the umask.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# Batches -------------------------------------------------------------------------------


def batch_of_rows(rows: PackedRows, index: np.ndarray) -> dict[str, np.ndarray]:
    """The batch of rows ``index`` ``[B]``: five int32 ``[B, T]`` arrays."""
    tokens, segment_ids = rows.tokens[index], rows.segment_ids[index]
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": rows.positions[index, :-1],
        "segment_ids": segment_ids[:, :-1],
        # A target counts when it continues the input's document: the EOS after a
        # document's last token does, the first token of the next document does not.
        "mask": (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(np.int32),
    }


def _process_slice(global_batch: int, process_index: int | None, process_count: int | None) -> slice:
    """This process's rows ``[lo, hi)`` of a global batch."""
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    if global_batch % count:
        raise ValueError(f"global_batch={global_batch} is not divisible by process_count={count}")
    if not 0 <= index < count:
        raise ValueError(f"process_index={index} must be in [0, process_count={count})")
    per = global_batch // count
    return slice(index * per, (index + 1) * per)


def eval_rows(
    n_rows: int,
    global_batch: int,
    n: int | None = None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> list[np.ndarray]:
    """This process's row indices of the first ``n`` (default: all whole) batches of a
    split of ``n_rows`` rows, in order, unshuffled: what ``eval_batches`` holds."""
    local = _process_slice(global_batch, process_index, process_count)
    available = n_rows // global_batch
    n = available if n is None else n
    if available < n or available == 0:
        raise ValueError(
            f"the dataset has {n_rows} rows, fewer than {max(n, 1)} batch(es) of "
            f"global_batch={global_batch}"
        )
    return [(k * global_batch + np.arange(global_batch))[local] for k in range(n)]


def eval_batches(
    rows: PackedRows,
    global_batch: int,
    n: int | None = None,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """The first ``n`` (default: all whole) batches of ``rows`` in order, unshuffled, as
    this process's slices in ``jaxpar.train.loader.Loader.batch``'s format: the same every
    evaluation."""
    indices = eval_rows(len(rows), global_batch, n, process_index=process_index, process_count=process_count)
    return [batch_of_rows(rows, index) for index in indices]
