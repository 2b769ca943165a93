"""The teacher cache of GliDe draft training (``glide.teacher_cache=DIR``): what a draft
step needs of its frozen target, computed once per corpus and reused across epochs and
runs, so a step from the cache never runs the target.

Per packed row (``jaxpar.train.data.PackedRows``) of the rows a draft trains on
(``glide.train_rows`` of the training split) and of the validation rows its evaluation
reads, the cache holds, for every position ``t < seq_len``:

  k, v           ``[T, L_d, K, H]`` in the target's compute dtype (bit for bit what the
                 live teacher gives): the teacher-forced keys (rotated) and values of
                 the ``L_d`` target layers the draft reads (its last ``glide.layers``);
  topk_logprobs  ``[T, k]`` float32: the target's ``k`` (``glide.teacher_topk``, at
                 most the vocabulary) largest next-token log-probabilities, normalised
                 over the whole vocabulary (what distillation renormalises);
  topk_ids       ``[T, k]``: their token ids, uint16 when the vocabulary has at most
                 65,536 tokens, else int32;
  features       ``[T, D]`` in the compute dtype, with ``glide.features`` only: the
                 target's final-normed last hidden state (a draft's EAGLE input).

Disk size per token: ``2 * L_d * K * H * itemsize + k * (4 + id_bytes)`` bytes. For
SmolLM2-135M (K=3, H=64, float32 from Hugging Face, 49,152 tokens), one draft layer and
k=64: 1,536 + 384 = 1,920 bytes, 240 KiB per 128-token row; the ``tiny`` preset (K=2,
H=32, float32, 4,096 tokens): 512 + 384 = 896 bytes. ``glide.features`` adds
``D * itemsize``: 2,304 bytes for SmolLM2 (D=576). (``Spec.bytes_per_token``.)

Rows are cached rather than batches, so any batch size, seed and epoch order reads the
same cache. Layout of ``DIR``: ``manifest.json`` and per split (``train``,
``validation``) shards of ``shard_rows`` consecutive cached rows,
``{split}-{index:05d}.{array}.npy``. Shards are plain NumPy ``.npy`` files, read
memory-mapped (``np.load(mmap_mode="r")``): a batch gathers its rows from the shards
without reading the rest, which ``.npz`` (no memory mapping) or safetensors (``safe_open``
slices contiguous ranges; a batch's rows are scattered) would not give as simply. bfloat16
K/V are stored as their 2-byte words and viewed back by the manifest's dtype (``.npy``
has no bfloat16 type).

The manifest (JSON) names what the cache was built for: the target (its model config
and a sha256 of its parameters), the tokenizer (sha256 of its JSON), the corpus (the
data config, informational, and a sha256 of the packed rows cached: the data, the
tokenizer and ``seq_len`` all change it), the layout (``seq_len``, rows per split,
``shard_rows``), the layers read, ``k`` and the dtypes, plus the shard list and
``complete``. ``open_cache`` refuses a cache built for anything else in one line naming
the first difference (``TeacherCacheMismatch``, a ``ConfigError``: the CLI exits 2).

Writing: the manifest first, with ``complete: false``; each shard file to a temporary
name and ``os.replace``d into place; ``complete: true`` last. A cache found incomplete
(an interrupted build) has its missing or unreadable shards computed and is completed;
one found complete has its shard files' shapes checked before use. Building runs in
one process (``jax.process_count() == 1``); reading works in any.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.train.config import ConfigError
from jaxpar.train.data import PackedRows, batch_of_rows, write_atomic

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
ARRAYS = ("k", "v", "topk_logprobs", "topk_ids")  # every cache's; "features" with glide.features
# The batch keys the cached arrays become (what jaxpar.train.glide.loss_fn reads).
BATCH_KEYS = {"k": "target_k", "v": "target_v", "topk_logprobs": "target_topk_logprobs",
              "topk_ids": "target_topk_ids", "features": "target_features"}
# Shards hold about this many bytes: big enough that a cache has few files, small enough
# that an interrupted build loses little.
SHARD_BYTES = 64 << 20


class TeacherCacheMismatch(ConfigError):
    """A teacher cache built for another target, corpus or layout (one line)."""


def params_fingerprint(model: nnx.Module) -> str:
    """sha256 of a model's parameters (every array's path, dtype, shape and bytes, in
    path order): the target's identity whatever its source (run, Hugging Face, GGUF).
    About a second for SmolLM2-135M's 540 MB on this CPU."""
    h = hashlib.sha256()
    for path, var in sorted(nnx.to_flat_state(nnx.state(model)), key=lambda item: str(item[0])):
        array = np.asarray(var.get_value())
        h.update(f"{path}:{array.dtype}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def rows_fingerprint(rows: PackedRows) -> str:
    """sha256 of packed rows (tokens, segment ids, positions)."""
    h = hashlib.sha256()
    for array in (rows.tokens, rows.segment_ids, rows.positions):
        h.update(f"{array.dtype}:{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype of ``topk_ids`` for a vocabulary: uint16 up to 65,536 tokens."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a cache holds and what it was built for: ``identity`` (compared with a found
    manifest's) and the arrays' per-row shapes and dtypes."""

    identity: dict
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    rows: dict[str, int]  # split -> rows cached

    @property
    def arrays(self) -> tuple[str, ...]:
        """The arrays cached per row: ``ARRAYS``, and ``features`` with them."""
        return tuple(self.shapes)

    @property
    def bytes_per_token(self) -> int:
        T = self.shapes["k"][0]
        return sum(np.dtype(self.dtypes[n]).itemsize * int(np.prod(self.shapes[n])) for n in self.arrays) // T


def spec(target, target_fingerprint: str, tokenizer_json: str, data_config: dict,
         rows: dict[str, PackedRows], layers: range, topk: int, features: bool = False) -> Spec:
    """The ``Spec`` of a cache of ``rows`` (split -> the packed rows cached, in cache
    order) for ``target`` (a ``Transformer``; ``target_fingerprint`` its
    ``params_fingerprint``), reading target ``layers`` and the top ``topk`` tokens, and
    with ``features`` the target's features too."""
    cfg = target.cfg
    T = next(iter(rows.values())).seq_len
    k = min(topk, cfg.vocab_size)
    kv = (T, len(layers), cfg.kv_heads, cfg.head_dim)
    dtypes = {"k": cfg.compute_dtype.name, "v": cfg.compute_dtype.name, "topk_logprobs": "float32",
              "topk_ids": id_dtype(cfg.vocab_size).name}
    identity = {
        "format": FORMAT,
        "target": {"model": json.loads(json.dumps(dataclasses.asdict(cfg))), "params_sha256": target_fingerprint},
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(),
        "data": {"config": json.loads(json.dumps(data_config)),
                 "rows_sha256": {split: rows_fingerprint(r) for split, r in rows.items()}},
        "layout": {"seq_len": T, "rows": {split: len(r) for split, r in rows.items()}},
        "layers": [layers.start, layers.stop],
        "topk": k,
        "dtypes": dtypes,
    }
    shapes = {"k": kv, "v": kv, "topk_logprobs": (T, k), "topk_ids": (T, k)}
    if features:
        shapes["features"] = (T, cfg.dim)
        dtypes["features"] = cfg.compute_dtype.name
        identity["arrays"] = list(shapes)  # absent: ARRAYS (the caches made before features)
    return Spec(identity, shapes, dtypes, {split: len(r) for split, r in rows.items()})


def _difference(found: dict, wanted: dict) -> str | None:
    """The first difference between a found manifest's identity and the wanted one, as
    ``another WHAT (DETAIL: X there, Y here)``; None when they match."""
    def first(a: dict, b: dict, prefix: str) -> str | None:
        for key in b:
            if a.get(key) != b[key]:
                return f"{prefix}{key}: {a.get(key)!r} there, {b[key]!r} here"
        return None

    if found.get("format") != wanted["format"]:
        return f"another format (format: {found.get('format')!r} there, {wanted['format']!r} here)"
    target, here = found.get("target", {}), wanted["target"]
    if target.get("model") != here["model"]:
        return f"another target ({first(target.get('model', {}), here['model'], 'model.')})"
    if target.get("params_sha256") != here["params_sha256"]:
        return (f"another target (its parameters differ: sha256 {str(target.get('params_sha256'))[:12]} "
                f"there, {here['params_sha256'][:12]} here)")
    if found.get("tokenizer_sha256") != wanted["tokenizer_sha256"]:
        return "another corpus (another tokenizer)"
    layout, data = found.get("layout", {}), found.get("data", {})
    if layout.get("seq_len") != wanted["layout"]["seq_len"]:
        return f"another corpus (seq_len: {layout.get('seq_len')!r} there, {wanted['layout']['seq_len']!r} here)"
    for split, count in wanted["layout"]["rows"].items():
        there = layout.get("rows", {}).get(split)
        if there != count:
            what = "glide.train_rows" if split == "train" else "eval.batches x batch_size"
            return f"another corpus ({split} rows, {what}: {there!r} there, {count!r} here)"
    for split, digest in wanted["data"]["rows_sha256"].items():
        if data.get("rows_sha256", {}).get(split) != digest:
            named = first(data.get("config", {}), wanted["data"]["config"], "data.")
            return f"another corpus (its {split} rows differ" + (f"; {named})" if named else ")")
    arrays = found.get("arrays", list(ARRAYS)), wanted.get("arrays", list(ARRAYS))
    if arrays[0] != arrays[1]:
        return f"other arrays (glide.features: {'features' in arrays[0]} there, {'features' in arrays[1]} here)"
    for key, name in (("layers", "target layers read, glide.layers"), ("topk", "glide.teacher_topk"),
                      ("dtypes", "dtypes")):
        if found.get(key) != wanted[key]:
            return f"another {key} ({name}: {found.get(key)!r} there, {wanted[key]!r} here)"
    return None


class TeacherCache:
    """An open, complete cache: ``rows(split, indices)`` gathers cached rows."""

    def __init__(self, directory: pathlib.Path, manifest: dict):
        self.directory, self.manifest = directory, manifest
        self.shard_rows = manifest["shard_rows"]
        self._arrays: dict[tuple[str, int, str], np.ndarray] = {}

    def _array(self, split: str, shard: int, name: str) -> np.ndarray:
        key = (split, shard, name)
        if key not in self._arrays:
            array = np.load(self.directory / _file(split, shard, name), mmap_mode="r")
            self._arrays[key] = array.view(jnp.dtype(self.manifest["identity"]["dtypes"][name]))
        return self._arrays[key]

    def rows(self, split: str, indices: np.ndarray, names=ARRAYS) -> dict[str, np.ndarray]:
        """The cached arrays ``names`` of rows ``indices [n]`` (indices into the split's
        cached rows), as batch keys (``BATCH_KEYS``): ``[n, T, ...]`` each, the ids as int32."""
        indices = np.asarray(indices)
        shard, offset = indices // self.shard_rows, indices % self.shard_rows
        out = {}
        for name in names:
            parts = {s: self._array(split, int(s), name)[offset[shard == s]] for s in np.unique(shard)}
            first = next(iter(parts.values()))
            array = np.empty((len(indices), *first.shape[1:]), first.dtype)
            for s, part in parts.items():
                array[shard == s] = part
            out[BATCH_KEYS[name]] = array.astype(np.int32) if name == "topk_ids" else array
        return out


def _file(split: str, shard: int, name: str) -> str:
    return f"{split}-{shard:05d}.{name}.npy"


def _write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    write_atomic(directory / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def _shard_ok(directory: pathlib.Path, split: str, shard: int, count: int, spec_: Spec) -> bool:
    """Whether all of shard ``shard``'s files are there, whole, of ``count`` rows."""
    for name in spec_.arrays:
        try:
            array = np.load(directory / _file(split, shard, name), mmap_mode="r")
        except (OSError, ValueError):
            return False
        if array.shape != (count, *spec_.shapes[name]) or array.dtype.itemsize != np.dtype(
                jnp.dtype(spec_.dtypes[name])).itemsize:
            return False
    return True


def _shards(rows: int, shard_rows: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + shard_rows, rows)) for lo in range(0, rows, shard_rows)]


def open_cache(directory, spec_: Spec, rows: dict[str, PackedRows], compute: Callable,
               batch_size: int) -> TeacherCache:
    """The cache in ``directory`` for ``spec_``, built or completed first when needed.

    Args:
      directory: the cache directory (made when missing).
      spec_: what it must hold (``spec``).
      rows: split -> the packed rows to cache, in cache order.
      compute: ``batch -> {array name: [B, T, ...] numpy}`` for a ``batch_of_rows``
        batch of ``batch_size`` rows (the live teacher).
      batch_size: rows per ``compute`` call.

    Raises:
      TeacherCacheMismatch: the directory holds a cache built for something else, or
        files that are not a teacher cache.
    """
    directory = pathlib.Path(directory)
    path = directory / MANIFEST
    if path.is_file():
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise TeacherCacheMismatch(f"glide.teacher_cache={str(directory)!r}: {MANIFEST} is not "
                                       "valid JSON; delete the directory to rebuild it") from None
        difference = _difference(manifest.get("identity", {}), spec_.identity)
        if difference is not None:
            raise TeacherCacheMismatch(f"glide.teacher_cache={str(directory)!r} was built for "
                                       f"{difference}; use another directory")
    elif directory.is_dir() and any(p.name != MANIFEST for p in directory.iterdir()):
        raise TeacherCacheMismatch(f"glide.teacher_cache={str(directory)!r} is not empty and holds no "
                                   f"{MANIFEST}: not a teacher cache")
    else:
        if jax.process_count() > 1:
            raise ConfigError("building a glide.teacher_cache runs in one process; build it with a "
                              "one-process run first")
        # Rows per shard: about SHARD_BYTES, whole compute batches.
        per_row = spec_.bytes_per_token * spec_.identity["layout"]["seq_len"]
        shard_rows = max(1, SHARD_BYTES // per_row // batch_size) * batch_size
        manifest = {"identity": spec_.identity, "shard_rows": shard_rows,
                    "bytes_per_token": spec_.bytes_per_token, "complete": False,
                    "shards": {split: [{"rows": [lo, hi], "files": [_file(split, i, a) for a in spec_.arrays]}
                                       for i, (lo, hi) in enumerate(_shards(n, shard_rows))]
                               for split, n in spec_.rows.items()}}
        directory.mkdir(parents=True, exist_ok=True)
        _write_manifest(directory, manifest)
    shard_rows = manifest["shard_rows"]
    missing = [(split, i, lo, hi) for split, n in spec_.rows.items()
               for i, (lo, hi) in enumerate(_shards(n, shard_rows))
               if not _shard_ok(directory, split, i, hi - lo, spec_)]
    if missing:
        if jax.process_count() > 1:
            raise ConfigError(f"glide.teacher_cache={str(directory)!r} is incomplete; complete it with "
                              "a one-process run first")
        if manifest["complete"]:
            log.warning("teacher cache %s: %d shard(s) missing or unreadable; recomputing them",
                        directory, len(missing))
        else:
            log.info("teacher cache %s: computing %d shard(s)", directory, len(missing))
        manifest["complete"] = False
        _write_manifest(directory, manifest)
        _build(directory, missing, rows, compute, batch_size, manifest, spec_.arrays)
    if not manifest["complete"]:
        manifest["complete"] = True
        _write_manifest(directory, manifest)
    return TeacherCache(directory, manifest)


def _build(directory: pathlib.Path, missing, rows: dict[str, PackedRows], compute: Callable,
           batch_size: int, manifest: dict, names: tuple[str, ...]) -> None:
    """Computes and writes the ``missing`` shards ``(split, index, lo, hi)``, in batches
    of ``batch_size`` rows (the last padded with the shard's first rows)."""
    for stale in directory.glob(".*.tmp"):  # the temporary files of an interrupted build
        stale.unlink(missing_ok=True)
    began, done = time.perf_counter(), 0
    total = sum(hi - lo for _, _, lo, hi in missing)
    masses = []
    for split, index, lo, hi in missing:
        parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
        for start in range(lo, hi, batch_size):
            wanted = np.arange(start, min(start + batch_size, hi))
            padded = np.concatenate([wanted, np.full(batch_size - len(wanted), lo)])
            out = compute(batch_of_rows(rows[split], padded))
            for name in names:
                parts[name].append(np.asarray(out[name])[: len(wanted)])
        arrays = {name: np.concatenate(parts[name]) for name in names}
        arrays["topk_ids"] = arrays["topk_ids"].astype(manifest["identity"]["dtypes"]["topk_ids"])
        masses.append(np.exp(arrays["topk_logprobs"]).sum(-1).mean())
        for name in names:
            array = arrays[name]
            if array.dtype.kind == "V" or array.dtype.name == "bfloat16":  # .npy has no bfloat16
                array = array.view(np.uint16)
            write_atomic(directory / _file(split, index, name), lambda f, a=array: np.save(f, a))
        done += hi - lo
        log.info("teacher cache %s: %d/%d rows in %.0f s", directory, done, total, time.perf_counter() - began)
    manifest["topk_mass"] = float(np.mean(masses))  # the target's probability its top-k holds
