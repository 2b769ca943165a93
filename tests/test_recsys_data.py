"""Recommendation data (train/recsys_data.py) and AUC (train/auc.py): Criteo parsing and
packing, loader determinism, bad input, the synthetic Zipf stream."""

import gzip
import math
import os

import numpy as np
import pytest

from jaxpar.train import recsys_data
from jaxpar.train.auc import auc
from jaxpar.train.recsys_data import (RecsysArrays, RecsysLoader, SyntheticData, eval_batches, pack_criteo,
                                      parse_criteo, recsys_loader)

ROWS = (7, 16) + tuple(range(100, 124))  # 26 tables


def _line(label, dense, cats) -> str:
    return "\t".join([str(label)] + ["" if v is None else str(v) for v in dense] + cats)


def _lines(n, seed=0):
    """n random Criteo lines (about a fifth of the values missing), and their expected arrays."""
    rng = np.random.default_rng(seed)
    text, labels, dense, sparse = [], [], [], []
    for _ in range(n):
        d = [None if rng.random() < 0.2 else int(rng.integers(-3, 5000)) for _ in range(13)]
        c = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
        y = int(rng.integers(0, 2))
        text.append(_line(y, d, c))
        labels.append(y)
        dense.append([math.log1p(max(v or 0, 0)) for v in d])
        sparse.append([int(h, 16) % m if h else 0 for h, m in zip(c, ROWS)])
    return text, (np.array(labels, np.float32), np.array(dense, np.float32), np.array(sparse, np.int32))


def _write(path, lines, gz=False):
    data = ("\n".join(lines) + "\n").encode() if lines else b""
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def _same(arrays: RecsysArrays, expected):
    for got, want in zip((arrays.labels, arrays.dense, arrays.sparse), expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_transforms_by_hand(tmp_path):
    line = _line(1, [9, -3, None, 0] + [1] * 9, ["ff", "10", ""] + ["1"] * 23)
    [chunk] = parse_criteo(_write(tmp_path / "day_0", [line]), ROWS)
    assert chunk.labels.tolist() == [1.0]
    np.testing.assert_allclose(chunk.dense[0, :5], [math.log(10), 0, 0, 0, math.log(2)], rtol=1e-6)
    # 0xff = 255 = 36 * 7 + 3; 0x10 = 16 % 16 = 0; missing -> 0; 1 % 100 = 1.
    assert chunk.sparse[0, :4].tolist() == [3, 0, 0, 1]


@pytest.mark.parametrize("gz", [False, True])
def test_parse_and_pack(tmp_path, gz):
    text, expected = _lines(50)
    path = _write(tmp_path / ("day_0.gz" if gz else "day_0"), text, gz)
    chunks = list(parse_criteo(path, ROWS, chunk_lines=16))  # streamed: 16 + 16 + 16 + 2
    assert [len(c) for c in chunks] == [16, 16, 16, 2]
    _same(RecsysArrays(*(np.concatenate([getattr(c, k) for c in chunks]) for k in ("labels", "dense", "sparse"))),
          expected)
    packed = pack_criteo(path, ROWS, cache_dir=tmp_path / "cache")
    assert isinstance(packed.sparse, np.memmap)
    _same(packed, expected)


def test_second_read_opens_the_memmaps(tmp_path, monkeypatch):
    text, expected = _lines(30)
    path = _write(tmp_path / "day_0", text)
    first = pack_criteo(path, ROWS)
    out = tmp_path / "day_0.packed"
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert set(stamps) == {"labels.npy", "dense.npy", "sparse.npy", "meta.json"}

    def no_parsing(*args):
        raise AssertionError("parsed again")

    with monkeypatch.context() as patch:
        patch.setattr(recsys_data, "_parse_chunk", no_parsing)
        second = pack_criteo(path, ROWS)
    _same(second, (np.asarray(first.labels), np.asarray(first.dense), np.asarray(first.sparse)))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    # Other table sizes, or a changed source, pack anew.
    other = (5,) + ROWS[1:]
    assert pack_criteo(path, other).sparse[:, 0].tolist() == [
        int(line.split("\t")[14] or "0", 16) % 5 for line in text]
    more, _ = _lines(31, seed=3)
    _write(path, more)
    os.utime(path, ns=(stamps["meta.json"] + 10**9,) * 2)
    assert len(pack_criteo(path, ROWS)) == 31


def test_interrupted_pack_leaves_nothing_complete_looking(tmp_path):
    text, _ = _lines(40)
    path = _write(tmp_path / "day_0", text)
    pack_criteo(path, ROWS)
    text[37] = text[37] + "\textra"
    _write(path, text)
    os.utime(path, ns=(1, 1))
    with pytest.raises(ValueError, match=":38: 41 tab-separated columns"):
        pack_criteo(path, ROWS)
    # The stale pack's meta.json is gone, and no temporary file is left behind.
    assert sorted(p.name for p in (tmp_path / "day_0.packed").iterdir()) == ["dense.npy", "labels.npy", "sparse.npy"]


@pytest.mark.parametrize("edit, message", [
    (lambda lines: lines.__setitem__(2, lines[2].rsplit("\t", 1)[0]),
     r"day_0:3: 39 tab-separated columns, expected 40 \(label, 13 integer, 26 hexadecimal categorical\)"),
    (lambda lines: lines.__setitem__(1, "\t".join(lines[1].split("\t")[:18] + ["zz12"] + lines[1].split("\t")[19:])),
     "day_0:2: categorical column C5 is 'zz12', not hexadecimal"),
    (lambda lines: lines.__setitem__(3, "\t".join(lines[3].split("\t")[:2] + ["1.5"] + lines[3].split("\t")[3:])),
     "day_0:4: integer column I2 is '1.5', not an integer"),
    (lambda lines: lines.__setitem__(0, "2" + lines[0][1:]), "day_0:1: label '2' is not 0 or 1"),
    (lambda lines: lines.clear(), "day_0: empty file, no Criteo lines"),
])
@pytest.mark.parametrize("gz", [False, True])
def test_bad_input_is_one_line(tmp_path, edit, message, gz):
    lines, _ = _lines(5)
    edit(lines)
    path = _write(tmp_path / "day_0", lines, gz)
    for read in (lambda: list(parse_criteo(path, ROWS)), lambda: pack_criteo(path, ROWS)):
        with pytest.raises(ValueError, match=message) as error:
            read()
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"needs 26 positive table sizes, got table_rows=\(7, 16\)"):
        pack_criteo(path, ROWS[:2])


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return RecsysArrays(rng.integers(0, 2, n).astype(np.float32), rng.random((n, 13), np.float32),
                        np.arange(n * 26, dtype=np.int32).reshape(n, 26))


def test_loader_is_a_function_of_seed_and_step():
    arrays = _arrays(100)
    a, b = RecsysLoader(arrays, 16, seed=3), RecsysLoader(arrays, 16, seed=3)
    for key, value in a.batch(7).items():
        np.testing.assert_array_equal(value, b.batch(7)[key])
    assert not np.array_equal(a.batch(7)["sparse"], RecsysLoader(arrays, 16, seed=4).batch(7)["sparse"])
    stream = [next(a) for _ in range(8)]
    b.restore({**a.state(), "step": 5})  # resume from step 5
    for want in stream[5:]:
        np.testing.assert_array_equal(next(b)["sparse"], want["sparse"])
    # One epoch (6 batches of 16, then 4 rows into the next) visits every row once.
    rows = np.concatenate([s["sparse"][:, 0] // 26 for s in stream])[:100]
    assert sorted(rows.tolist()) == list(range(100))
    with pytest.raises(ValueError, match="seed=3 but this loader has seed=4"):
        RecsysLoader(arrays, 16, seed=4).restore(a.state())


def test_eval_is_the_held_out_tail(tmp_path):
    text, expected = _lines(60)
    path = _write(tmp_path / "day_0", text)
    loader, held_out = recsys_loader("criteo", ROWS, 8, seed=0, path=path, cache_dir=tmp_path, eval_fraction=0.25)
    assert len(loader.rows) == 45 and len(held_out) == 1  # 15 held-out rows: one whole batch of 8
    np.testing.assert_array_equal(held_out[0]["sparse"], expected[2][45:53])
    assert [b["labels"].tolist() for b in eval_batches(RecsysArrays(*expected), 20)] == [
        expected[0][:20].tolist(), expected[0][20:40].tolist(), expected[0][40:].tolist()]
    with pytest.raises(ValueError, match="data.format='parquet' must be one of"):
        recsys_loader("parquet", ROWS, 8, seed=0)


def test_synthetic_ids_in_range_and_deterministic():
    rows = (50, 1000, 7, 20000)
    data = SyntheticData(rows, 512, alpha=1.2, seed=5)
    ids = data.ids(3)
    assert ids.shape == (512, 4) and ids.dtype == np.int32
    assert (ids >= 0).all() and (ids < np.array(rows)).all()
    offsets = np.array([0, 50, 1050, 1057])
    np.testing.assert_array_equal(data.ids(3, global_rows=True), ids + offsets)
    np.testing.assert_array_equal(SyntheticData(rows, 512, alpha=1.2, seed=5).ids(3), ids)
    assert not np.array_equal(SyntheticData(rows, 512, alpha=1.2, seed=6).ids(3), ids)
    batch = data.batch(3)
    np.testing.assert_array_equal(batch["sparse"], ids)
    assert batch["dense"].shape == (512, 13) and batch["dense"].dtype == np.float32
    assert set(np.unique(batch["labels"])) == {0.0, 1.0}
    stream = [next(data) for _ in range(4)]
    resumed = SyntheticData(rows, 512, alpha=1.2, seed=5)
    resumed.restore({**data.state(), "step": 2})
    np.testing.assert_array_equal(next(resumed)["labels"], stream[2]["labels"])
    pooled = SyntheticData(rows, 64, pooling=3).ids(0)
    assert pooled.shape == (64, 4, 3) and (pooled < np.array(rows)[:, None]).all()


def _top_share(alpha, rows=20_000):
    data = SyntheticData((rows,), 4096, alpha=alpha, seed=0)
    counts = np.bincount(np.concatenate([data.ids(s)[:, 0] for s in range(12)]), minlength=rows)
    return np.sort(counts)[::-1][: rows // 100].sum() / counts.sum(), int(np.argmax(counts))


def test_synthetic_zipf_skew():
    share_105, _ = _top_share(1.05)
    share_12, hottest_12 = _top_share(1.2)
    # The top 1% of ids take 29% of lookups at alpha 1.05 and 69% at 1.2 (uniform: 1%).
    assert 0.2 < share_105 < 0.4 and 0.6 < share_12 < 0.8, (share_105, share_12)
    assert hottest_12 != 0  # the fixed permutation scatters the hot ids


def test_synthetic_reuse_copies_from_the_previous_batch():
    rows = (100_000,) * 3
    data = SyntheticData(rows, 2048, alpha=1.05, reuse=0.5, seed=1)
    stream = [data.ids(s) for s in range(12)]
    same = np.mean([(stream[s] == stream[s - 1]).mean() for s in range(1, 12)])
    assert 0.49 < same < 0.53, same  # 0.5 copied (less 0.5 ** 8), plus chance repeats of hot ids
    no_reuse = SyntheticData(rows, 2048, alpha=1.05, seed=1)
    assert (no_reuse.ids(5) == no_reuse.ids(4)).mean() < 0.1
    # Random access equals sequential reading: the stream is a function of (seed, step).
    np.testing.assert_array_equal(SyntheticData(rows, 2048, alpha=1.05, reuse=0.5, seed=1).ids(11), stream[11])


def test_synthetic_signal_is_planted():
    data = SyntheticData((300, 5000, 40), 4096, alpha=1.2, seed=2)
    batch = data.batch(0)
    oracle = auc(data.true_logits(batch["dense"], batch["sparse"]), batch["labels"])
    assert 0.8 < oracle < 0.9, oracle
    assert abs(auc(batch["dense"][:, 0], batch["labels"]) - 0.5) < 0.1  # one feature alone says little


def _brute_auc(scores, labels):
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def test_auc_equals_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    for n in (2, 7, 300, 1001):
        scores = np.round(rng.standard_normal(n), 1)  # many ties
        labels = rng.integers(0, 2, n)
        labels[:2] = [0, 1]
        assert abs(auc(scores, labels) - _brute_auc(scores, labels)) < 1e-12
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    assert auc([1, 1, 1], [0, 1, 0]) == 0.5
    with pytest.raises(ValueError, match="undefined with 3 positive and 0 negative"):
        auc([0.1, 0.2, 0.3], [1, 1, 1])
    with pytest.raises(ValueError, match="1 scores are NaN"):
        auc([0.1, np.nan], [0, 1])


def test_auc_equals_scipys_mann_whitney_u():
    """Against a peer's implementation: AUC is Mann-Whitney's U of the positives over the
    negatives, divided by n_pos * n_neg (scipy, which jax already installs)."""
    from scipy.stats import mannwhitneyu

    rng = np.random.default_rng(1)
    scores, labels = np.round(rng.standard_normal(500), 1), rng.integers(0, 2, 500)
    pos, neg = scores[labels == 1], scores[labels == 0]
    u = mannwhitneyu(pos, neg, alternative="two-sided").statistic
    assert abs(auc(scores, labels) - u / (len(pos) * len(neg))) < 1e-12
