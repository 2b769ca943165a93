"""Recommendation data: Criteo's TSV format, packed to memmaps, and a synthetic stream.

  parse_criteo      stream a Criteo Terabyte/Kaggle file (plain or gzip) as chunks of
                    transformed arrays: one line = label, 13 integer and 26 hexadecimal
                    categorical columns, tab separated, any column but the label empty
  pack_criteo       the packed form of a file (labels/dense/sparse .npy memmaps and a
                    meta.json), built on first read and opened without parsing after
  RecsysLoader      shuffled batches of packed rows; step s's batch is a pure function
                    of (seed, s) (``jaxpar.train.loader.Loader``'s order and state)
  eval_batches      the held-out tail's batches, in order
  SyntheticData     FBGEMM ``generate_requests``-style Zipf id streams with a planted
                    signal, batch s a pure function of (seed, s); ``ids`` alone for
                    cache benchmarks
  recsys_loader     (loader, eval batches) from the ``data.format`` / ``data.path`` /
                    ``data.zipf_alpha`` keys

Batches are dicts of numpy arrays: ``dense`` float32 [B, 13], ``sparse`` int32 [B, F]
(per-feature ids, each < its table's rows; ``DLRM.rows`` makes them global), ``labels``
float32 [B].

Transforms (DLRM's reference, ``data_utils.py``): dense ``log(1 + max(x, 0))`` with a
missing value read as 0; categorical ``int(hex, 16) % rows_of_its_table`` with a missing
value read as 0, so it lands on row 0 (shared with the values that hash there, as in
the reference).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import itertools
import json
import os
import pathlib
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np

from jaxpar.train import data as text_data
from jaxpar.train.loader import Loader

DENSE, SPARSE = 13, 26
COLUMNS = 1 + DENSE + SPARSE
FORMATS = ("criteo", "synthetic")
_PACK_VERSION = 1
_CHUNK_LINES = 65536
_HEX_DIGITS = b"0123456789abcdefABCDEF"


@dataclasses.dataclass(frozen=True)
class RecsysArrays:
    """Rows of labels float32 [N], dense float32 [N, 13], sparse int32 [N, F] (memmaps or arrays)."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index) -> dict[str, np.ndarray]:
        """The batch of rows ``index``, copied out of the memmaps."""
        return {"dense": np.asarray(self.dense[index], np.float32),
                "sparse": np.asarray(self.sparse[index], np.int32),
                "labels": np.asarray(self.labels[index], np.float32)}

    def split(self, held_out: int) -> tuple[RecsysArrays, RecsysArrays]:
        """(the first N - held_out rows, the last held_out rows): train and eval."""
        if not 0 < held_out < len(self):
            raise ValueError(f"held_out={held_out} rows must be in (0, {len(self)})")
        cut = len(self) - held_out
        head = RecsysArrays(self.labels[:cut], self.dense[:cut], self.sparse[:cut])
        return head, RecsysArrays(self.labels[cut:], self.dense[cut:], self.sparse[cut:])


# Criteo TSV ---------------------------------------------------------------------------


def _open(path) -> BinaryIO:
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _parse_chunk(lines: Sequence[bytes], path, first: int, rows: Sequence[int]) -> RecsysArrays:
    """Lines ``first, first + 1, ...`` (1-based) of ``path`` -> transformed arrays."""
    n = len(lines)
    labels = np.empty(n, np.float32)
    dense = np.empty((n, DENSE), np.float64)
    sparse = np.empty((n, SPARSE), np.int32)
    for k, line in enumerate(lines):
        cols = line.rstrip(b"\r\n").split(b"\t")
        where = f"{path}:{first + k}"
        if len(cols) != COLUMNS:
            raise ValueError(f"{where}: {len(cols)} tab-separated columns, expected {COLUMNS} "
                             f"(label, {DENSE} integer, {SPARSE} hexadecimal categorical)")
        if cols[0] not in (b"0", b"1"):
            raise ValueError(f"{where}: label {cols[0].decode(errors='replace')!r} is not 0 or 1")
        labels[k] = cols[0] == b"1"
        try:
            dense[k] = [int(v) if v else 0 for v in cols[1:1 + DENSE]]
        except ValueError:
            j, bad = next((j, v) for j, v in enumerate(cols[1:1 + DENSE]) if v and not _is_int(v))
            raise ValueError(f"{where}: integer column I{j + 1} is {bad.decode(errors='replace')!r}, "
                             "not an integer") from None
        cats = cols[1 + DENSE:]
        if b"".join(cats).translate(None, _HEX_DIGITS):
            j, bad = next((j, v) for j, v in enumerate(cats) if v.translate(None, _HEX_DIGITS))
            raise ValueError(f"{where}: categorical column C{j + 1} is {bad.decode(errors='replace')!r}, "
                             "not hexadecimal")
        sparse[k] = [int(v, 16) % m if v else 0 for v, m in zip(cats, rows)]
    dense = np.log1p(np.maximum(dense, 0)).astype(np.float32)
    return RecsysArrays(labels, dense, sparse)


def _is_int(v: bytes) -> bool:
    try:
        int(v)
    except ValueError:
        return False
    return True


def _check_rows(table_rows: Sequence[int]) -> tuple[int, ...]:
    rows = tuple(int(r) for r in table_rows)
    if len(rows) != SPARSE or min(rows) < 1:
        raise ValueError(f"Criteo data needs {SPARSE} positive table sizes, got table_rows={rows!r}")
    return rows


def parse_criteo(path, table_rows: Sequence[int], *, chunk_lines: int = _CHUNK_LINES) -> Iterator[RecsysArrays]:
    """Streams ``path`` (plain or gzip, by its magic bytes) as transformed chunks of at
    most ``chunk_lines`` rows; never holds more than one chunk. Raises ValueError with
    the file and line on a bad line, and on an empty file."""
    rows = _check_rows(table_rows)
    first = 1
    with _open(path) as f:
        while lines := list(itertools.islice(f, chunk_lines)):
            yield _parse_chunk(lines, path, first, rows)
            first += len(lines)
    if first == 1:
        raise ValueError(f"{path}: empty file, no Criteo lines")


def _count_lines(path) -> int:
    with _open(path) as f:
        return sum(1 for _ in f)


def pack_criteo(path, table_rows: Sequence[int], cache_dir=None) -> RecsysArrays:
    """The packed arrays of Criteo file ``path`` hashed into ``table_rows``, as read-only
    memmaps.

    They live in ``<path>.packed/`` or, with ``cache_dir``, in ``cache_dir/<name>-<hash
    of the path>.packed/``: ``labels.npy`` float32 [N], ``dense.npy`` float32 [N, 13],
    ``sparse.npy`` int32 [N, 26] and ``meta.json`` (the source's size and mtime, the table
    sizes, N). A later call whose source and table sizes match opens the memmaps without
    parsing; otherwise the file is packed anew. Arrays are written under temporary names
    and renamed into place, and meta.json is removed first and written last, so an
    interrupted pack never looks complete.
    """
    src = pathlib.Path(path).resolve()
    rows = _check_rows(table_rows)
    stat = src.stat()
    key = {"version": _PACK_VERSION, "source": str(src), "size": stat.st_size,
           "mtime_ns": stat.st_mtime_ns, "table_rows": list(rows)}
    if cache_dir is None:
        out = src.with_name(src.name + ".packed")
    else:
        out = pathlib.Path(cache_dir) / f"{src.name}-{hashlib.sha1(str(src).encode()).hexdigest()[:12]}.packed"
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in key} == key:
            arrays = _open_packed(out)
            if all(len(a) == meta["n"] for a in (arrays.labels, arrays.dense, arrays.sparse)):
                return arrays
    out.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)
    n = _count_lines(src)
    if n == 0:
        raise ValueError(f"{path}: empty file, no Criteo lines")
    tag = uuid.uuid4().hex
    shapes = {"labels": ((n,), np.float32), "dense": ((n, DENSE), np.float32), "sparse": ((n, SPARSE), np.int32)}
    tmp = {name: out / f"{name}.tmp-{tag}.npy" for name in shapes}
    try:
        maps = {name: np.lib.format.open_memmap(tmp[name], mode="w+", dtype=dt, shape=shape)
                for name, (shape, dt) in shapes.items()}
        at = 0
        for chunk in parse_criteo(path, rows):
            if at + len(chunk) > n:
                raise ValueError(f"{path}: changed while it was packed")
            for name, m in maps.items():
                m[at:at + len(chunk)] = getattr(chunk, name)
            at += len(chunk)
        if at != n:
            raise ValueError(f"{path}: changed while it was packed")
        for name, m in maps.items():
            m.flush()
        del maps, m
        for name in shapes:
            os.replace(tmp[name], out / f"{name}.npy")
        meta_tmp = out / f"meta.tmp-{tag}.json"
        meta_tmp.write_text(json.dumps({**key, "n": n}))
        os.replace(meta_tmp, meta_path)
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return _open_packed(out)


def _open_packed(out: pathlib.Path) -> RecsysArrays:
    return RecsysArrays(*(np.load(out / f"{name}.npy", mmap_mode="r") for name in ("labels", "dense", "sparse")))


class RecsysLoader(Loader):
    """Shuffled training batches of packed rows (see ``jaxpar.train.loader.Loader``: step
    s's batch is a pure function of (seed, s); ``state()`` is the step and what must
    match; ``restore`` continues exactly). ``rows`` is a ``RecsysArrays``."""

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows.take(self.local_rows(step))


def eval_batches(arrays: RecsysArrays, global_batch: int, n: int | None = None, *,
                 process_index=None, process_count=None) -> list[dict[str, np.ndarray]]:
    """The first ``n`` (default: all whole) batches of ``arrays``, in order."""
    return [arrays.take(index) for index in text_data.eval_rows(
        len(arrays), global_batch, n, process_index=process_index, process_count=process_count)]


# Synthetic ----------------------------------------------------------------------------


class SyntheticData:
    """A Zipf id stream with a planted signal, FBGEMM ``generate_requests``'s statistics.

    Per feature f with ``table_rows[f] = E`` rows, an id is ``perm_f[(z - 1) % E]`` with
    ``z ~ Zipf(alpha)`` (numpy's unbounded Zipf folded into E, as FBGEMM's CPU path;
    ``alpha <= 1``: uniform, as FBGEMM) and ``perm_f`` a fixed random permutation, so the
    hot ids are scattered. ``pooling`` ids per feature and sample (drawn independently;
    the model takes 1). With ``reuse``, exactly ``int(B * pooling * reuse)`` positions per
    feature copy the previous batch's id there (FBGEMM's reuse). To keep a batch a pure
    function of (seed, step), "the previous batch" is followed back at most ``_REUSE_DEPTH``
    steps, so a fraction ``reuse * (1 - reuse ** (_REUSE_DEPTH - 1))`` is copied rather
    than ``reuse``; draws are memoised, so a sequential read costs one draw per step.

    The signal: a hidden weight per table row (normal, std ``signal / sqrt(F + 1)``) and
    per dense feature (on standardised features, the same std over all 13 together);
    ``label ~ Bernoulli(sigmoid(sum of the sample's row weights + dense . w))``
    (``true_logits``). Dense features are ``log1p(floor(Exp(scale_j)))``, scales from 1 to
    1000, Criteo-like counts. Eval batches are another stream of the same distribution.
    """

    _REUSE_DEPTH = 8

    def __init__(self, table_rows: Sequence[int], global_batch: int, *, alpha: float = 1.05, seed: int = 0,
                 dense_features: int = DENSE, reuse: float = 0.0, pooling: int = 1, signal: float = 2.0,
                 process_index=None, process_count=None):
        rows = tuple(int(r) for r in table_rows)
        if not rows or min(rows) < 1:
            raise ValueError(f"table_rows={rows!r} must be positive row counts")
        if not 0.0 <= reuse < 1.0:
            raise ValueError(f"reuse={reuse} must be in [0, 1)")
        if pooling < 1 or global_batch < 1:
            raise ValueError(f"pooling={pooling} and global_batch={global_batch} must be >= 1")
        self._local = text_data._process_slice(global_batch, process_index, process_count)
        self.rows, self.global_batch, self.alpha, self.seed = rows, global_batch, float(alpha), seed
        self.dense_features, self.reuse, self.pooling = dense_features, reuse, pooling
        self.offsets = np.concatenate([[0], np.cumsum(rows[:-1])]).astype(np.int64)
        rng = np.random.default_rng((seed, 0))
        self._perm = np.concatenate([rng.permutation(n) for n in rows]).astype(np.int32)  # [R]
        std = signal / np.sqrt(len(rows) + 1)
        self._row_weight = rng.normal(0.0, std, sum(rows)).astype(np.float32)  # [R]
        self._dense_weight = (rng.normal(0.0, std, dense_features) / np.sqrt(dense_features)).astype(np.float32)
        self._dense_scale = np.logspace(0, 3, dense_features)
        sample = self._dense(rng, 20000)
        self._dense_mean, self._dense_std = sample.mean(0), sample.std(0) + 1e-6
        self._memo: dict[tuple[int, int], dict] = {}
        self._lock = threading.Lock()
        self.step = 0

    def _dense(self, rng, n):
        return np.log1p(np.floor(rng.exponential(self._dense_scale, (n, self.dense_features)))).astype(np.float32)

    def _draw(self, stream: int, step: int) -> dict:
        """Step ``step``'s fresh ids [B, F, L], dense, label and reuse draws (memoised)."""
        with self._lock:
            if (stream, step) in self._memo:
                return self._memo[stream, step]
        rng = np.random.default_rng((self.seed, stream, step))
        B, F, L = self.global_batch, len(self.rows), self.pooling
        rows = np.asarray(self.rows)[:, None]
        if self.alpha > 1.0:
            z = (rng.zipf(self.alpha, (B, F, L)) - 1) % rows
        else:
            z = rng.integers(0, 2**62, (B, F, L)) % rows
        draw = {"ids": self._perm[z + self.offsets[:, None]],  # [B, F, L]
                "dense": self._dense(rng, B), "u": rng.random(B)}
        if self.reuse:
            k = int(B * L * self.reuse)
            order = np.argpartition(rng.random((B * L, F)), k, axis=0)[:k]  # [k, F]
            mask = np.zeros((B * L, F), bool)
            mask[order, np.arange(F)] = True
            draw["reuse"] = mask.reshape(B, L, F).transpose(0, 2, 1)  # [B, F, L]
        with self._lock:
            self._memo[stream, step] = draw
            while len(self._memo) > self._REUSE_DEPTH + 2:
                self._memo.pop(next(iter(self._memo)))
        return draw

    def _ids(self, stream: int, step: int) -> np.ndarray:
        first = max(0, step - self._REUSE_DEPTH) if self.reuse and stream == 1 else step
        ids = self._draw(stream, first)["ids"]
        for t in range(first + 1, step + 1):  # each batch copies its reused positions from the one before
            draw = self._draw(stream, t)
            ids = np.where(draw["reuse"], ids, draw["ids"])
        return ids

    def ids(self, step: int, *, global_rows: bool = False) -> np.ndarray:
        """int32 ids of step ``step``'s global batch: [B, F] (pooling 1) or [B, F, L];
        per feature, or rows of the concatenated table with ``global_rows``."""
        ids = self._ids(1, step) + (self.offsets[:, None] if global_rows else 0)
        return (ids[..., 0] if self.pooling == 1 else ids).astype(np.int32)

    def true_logits(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """The planted logits [B] of per-feature ids ``sparse`` [B, F(, L)] and ``dense``."""
        rows = sparse.reshape(len(sparse), len(self.rows), -1) + self.offsets[:, None]
        z = (dense - self._dense_mean) / self._dense_std
        return self._row_weight[rows].sum((1, 2)) + z @ self._dense_weight

    def _batch(self, stream: int, step: int) -> dict[str, np.ndarray]:
        if self.pooling != 1:
            raise ValueError(f"batches need pooling=1 (one id per feature), not pooling={self.pooling}")
        ids, draw = self._ids(stream, step)[..., 0], self._draw(stream, step)
        p = 1.0 / (1.0 + np.exp(-self.true_logits(draw["dense"], ids)))
        out = {"dense": draw["dense"], "sparse": ids.astype(np.int32), "labels": (draw["u"] < p).astype(np.float32)}
        return {k: v[self._local] for k, v in out.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's slice of step ``step``'s training batch."""
        return self._batch(1, step)

    def eval_batches(self, n: int) -> list[dict[str, np.ndarray]]:
        """``n`` held-out batches (another stream, no reuse): the same every call."""
        return [self._batch(2, k) for k in range(n)]

    def __iter__(self) -> SyntheticData:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch}

    def restore(self, state: dict) -> None:
        for name in ("seed", "global_batch"):
            if int(state[name]) != self.state()[name]:
                raise ValueError(f"loader state has {name}={int(state[name])} but this loader has "
                                 f"{name}={self.state()[name]}: not the same data stream")
        self.step = int(state["step"])


def recsys_loader(format: str, table_rows: Sequence[int], global_batch: int, *, seed: int, path=None,
                  zipf_alpha: float = 1.05, cache_dir=None, eval_fraction: float = 0.1, eval_steps: int = 8,
                  dense_features: int = DENSE):
    """``(loader, eval batches)`` for ``data.format`` (``criteo``: the packed file
    ``data.path`` with its last ``eval_fraction`` held out; ``synthetic``: the Zipf
    stream at ``data.zipf_alpha``, ``eval_steps`` held-out batches)."""
    if format == "synthetic":
        stream = SyntheticData(table_rows, global_batch, alpha=zipf_alpha, seed=seed, dense_features=dense_features)
        return stream, stream.eval_batches(eval_steps)
    if format != "criteo":
        raise ValueError(f"data.format={format!r} must be one of {FORMATS}")
    if path is None:
        raise ValueError("data.format=criteo needs data.path, a Criteo TSV file (plain or .gz)")
    arrays = pack_criteo(path, table_rows, cache_dir)
    train, held = arrays.split(max(global_batch, int(len(arrays) * eval_fraction)))
    return RecsysLoader(train, global_batch, seed=seed), eval_batches(held, global_batch)
