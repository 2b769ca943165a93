import json

import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from jaxpar.models import ModelConfig, Transformer
from jaxpar.train import data
from jaxpar.train.loader import Loader

# The first 60 standard-library files: a tokenizer trains on them in about a second.
SMALL = data.DataConfig(val_fraction=0.2, max_files=60)
VOCAB = 512
KEYS = ("inputs", "targets", "positions", "segment_ids", "mask")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def tokenizer(cache):
    return data.load_tokenizer(SMALL, VOCAB, cache)


def random_rows(rng, n_docs=40, seq_len=8) -> data.PackedRows:
    docs = [rng.integers(1, 100, rng.integers(0, 12)) for _ in range(n_docs)]
    return data.pack(docs, seq_len, eos_id=0)


def one_process(**kw):
    return dict(process_index=0, process_count=1, **kw)


# Corpus and split ----------------------------------------------------------------------


def test_stdlib_split_is_deterministic_and_disjoint_by_file():
    cfg = data.DataConfig()
    names = [d.name for d in data.corpus(cfg)]
    assert names == sorted(names) and len(set(names)) == len(names) > 1000
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    train = [d.name for d in data.split_documents(cfg, "train")]
    val = [d.name for d in data.split_documents(cfg, "validation")]
    assert train and val and not set(train) & set(val)
    assert sorted(train + val) == names
    assert 0.02 < len(val) / len(names) < 0.1  # val_fraction=0.05
    assert val == [d.name for d in data.split_documents(cfg, "validation")]
    # The split follows each file's name, not the corpus around it.
    assert all(data.split_of(n, 0.05) == "validation" for n in val)
    assert len(data.documents(cfg, "train")) == len(train)


def test_max_files_takes_the_first_files():
    names = [d.name for d in data.corpus(SMALL)]
    assert names == [d.name for d in data.corpus(data.DataConfig())][: len(names)]
    assert 50 < len(names) <= 60  # empty files (__init__.py) are skipped


def test_config_is_validated():
    with pytest.raises(ValueError, match="val_fraction"):
        data.DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="split='test'"):
        data.documents(SMALL, "test")


# Tokenizer -----------------------------------------------------------------------------


def test_tokenizer_round_trips(tokenizer):
    text = data.documents(SMALL, "train")[0][:3000]
    text += "\r\n\tnaïve — 日本語 🎉 \x00 <|endoftext|> x\n"
    (ids,) = data.tokenize(tokenizer, [text])
    assert ids.dtype == np.int32 and len(ids) < len(text.encode())
    assert tokenizer.decode(ids.tolist()) == text
    # A literal "<|endoftext|>" in a document is text, not EOS.
    assert data.eos_id(tokenizer) not in ids
    assert tokenizer.get_vocab_size() == 512


def test_tokenizer_is_cached(tokenizer, cache, monkeypatch):
    assert len(list(cache.glob("tokenizer-*.json"))) == 1

    def no_training(*args):
        raise AssertionError("trained again")

    monkeypatch.setattr(data, "_train_tokenizer", no_training)
    assert data.load_tokenizer(SMALL, VOCAB, cache).to_str() == tokenizer.to_str()
    # Another vocabulary, or another train split, is another key.
    for cfg, vocab in ((SMALL, 600), (data.DataConfig(val_fraction=0.2, max_files=59), VOCAB)):
        with pytest.raises(AssertionError, match="trained again"):
            data.load_tokenizer(cfg, vocab, cache)
    # So is another tokenizers release (its BPE trainer may merge differently).
    monkeypatch.setattr(data.tokenizers, "__version__", "0.0.1")
    with pytest.raises(AssertionError, match="trained again"):
        data.load_tokenizer(SMALL, VOCAB, cache)


def test_default_cache_dir_is_per_user(monkeypatch, tmp_path):
    """$XDG_CACHE_HOME/jaxpar, else ~/.cache/jaxpar (a relative XDG_CACHE_HOME is not one)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.default_cache_dir() == tmp_path / "xdg" / "jaxpar"
    for unset in ("", "relative/dir"):
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert data.default_cache_dir() == tmp_path / "home" / ".cache" / "jaxpar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data.default_cache_dir() == tmp_path / "home" / ".cache" / "jaxpar"


def test_given_tokenizer_and_vocab_check(tokenizer, tmp_path):
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    loaded = data.load_tokenizer(data.DataConfig(tokenizer=str(path)), VOCAB, tmp_path / "unused")
    assert loaded.to_str() == tokenizer.to_str()
    data.check_vocab(loaded, 512)
    with pytest.raises(ValueError, match="^tokenizer vocab 512 exceeds model.vocab_size 511$"):
        data.check_vocab(loaded, 511)
    # A table larger than the tokenizer (past padding to a multiple of 128) wastes rows.
    with pytest.raises(ValueError, match="^model.vocab_size=640 but the tokenizer has 512 tokens: 128 "
                                         "embedding rows would never be read; set model.vocab_size=512"):
        data.check_vocab(loaded, 640)
    with pytest.raises(ValueError, match="no such file"):
        data.load_tokenizer(data.DataConfig(tokenizer=str(tmp_path / "missing.json")), VOCAB, tmp_path)


# Packing -------------------------------------------------------------------------------


def test_pack_exact_layout():
    E = 0
    docs = [[11, 12], [21, 22, 23, 24, 25], [31], [41, 42, 43], [51]]
    rows = data.pack([np.array(d) for d in docs], seq_len=4, eos_id=E)
    # Stream: 11 12 E | 21 22 23 24 25 E | 31 E | 41 42 43 E | 51 E (17 tokens, 3 rows of 5).
    np.testing.assert_array_equal(rows.tokens, [
        [11, 12, E, 21, 22],
        [23, 24, 25, E, 31],
        [E, 41, 42, 43, E],
    ])
    np.testing.assert_array_equal(rows.segment_ids, [
        [1, 1, 1, 2, 2],
        [1, 1, 1, 1, 2],
        [1, 2, 2, 2, 2],   # the row starts with the EOS that ends document 31
    ])
    np.testing.assert_array_equal(rows.positions, [
        [0, 1, 2, 0, 1],
        [0, 1, 2, 3, 0],   # a continued document restarts at 0
        [0, 0, 1, 2, 3],
    ])
    assert all(a.dtype == np.int32 for a in (rows.tokens, rows.segment_ids, rows.positions))
    assert len(rows) == 3 and rows.seq_len == 4

    (batch,) = data.eval_batches(rows, 3, 1, **one_process())
    np.testing.assert_array_equal(batch["inputs"], rows.tokens[:, :-1])
    np.testing.assert_array_equal(batch["targets"], rows.tokens[:, 1:])
    np.testing.assert_array_equal(batch["positions"], rows.positions[:, :-1])
    np.testing.assert_array_equal(batch["segment_ids"], rows.segment_ids[:, :-1])
    # Predicting a document's EOS counts; predicting the next document's first token does not.
    np.testing.assert_array_equal(batch["mask"], [
        [1, 1, 0, 1],
        [1, 1, 1, 0],
        [0, 1, 1, 1],
    ])


def test_pack_keeps_every_token_but_the_tail(rng):
    docs = [rng.integers(1, 1000, rng.integers(0, 30)) for _ in range(50)]
    rows = data.pack(docs, seq_len=15, eos_id=0)
    stream = np.concatenate([np.append(d, 0) for d in docs])
    assert len(stream) - rows.tokens.size < 16
    np.testing.assert_array_equal(rows.tokens.ravel(), stream[: rows.tokens.size])
    # Positions count up within a segment, and a new segment starts at 0.
    for tok, seg, pos in zip(rows.tokens, rows.segment_ids, rows.positions):
        new = np.diff(seg) == 1
        assert set(np.diff(seg)) <= {0, 1} and seg[0] == 1
        np.testing.assert_array_equal(pos[1:][new], 0)
        np.testing.assert_array_equal(np.diff(pos)[~new], 1)
        assert np.all(tok[:-1][new] == 0)  # every document boundary follows an EOS


# Cached datasets -----------------------------------------------------------------------


def test_packed_rows_are_cached(tokenizer, cache, monkeypatch):
    rows = data.packed_rows(SMALL, tokenizer, 32, "train", cache)
    val = data.packed_rows(SMALL, tokenizer, 32, "validation", cache)
    assert rows.tokens.shape[1] == 33 and len(rows) > 100 and len(val) > 10
    assert rows.tokens.max() < 512
    assert len(list(cache.glob("packed-*-train-32.npz"))) == 1

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "tokenize", no_tokenizing)
    again = data.packed_rows(SMALL, tokenizer, 32, "train", cache)
    np.testing.assert_array_equal(again.tokens, rows.tokens)
    np.testing.assert_array_equal(again.positions, rows.positions)
    with pytest.raises(AssertionError, match="tokenized again"):
        data.packed_rows(SMALL, tokenizer, 16, "train", cache)


# Loader --------------------------------------------------------------------------------


def test_loader_is_a_pure_function_of_seed_and_step(rng):
    rows = random_rows(rng)
    a = Loader(rows, 8, seed=0, **one_process())
    b = Loader(rows, 8, seed=0, **one_process())
    for step in (0, 3, 100):
        for k in KEYS:
            np.testing.assert_array_equal(a.batch(step)[k], b.batch(step)[k])
    batch = a.batch(0)
    assert all(batch[k].shape == (8, 8) and batch[k].dtype == np.int32 for k in KEYS)
    assert not np.array_equal(a.batch(0)["inputs"], a.batch(1)["inputs"])
    c = Loader(rows, 8, seed=1, **one_process())
    assert not np.array_equal(a.batch(0)["inputs"], c.batch(0)["inputs"])
    # Without process arguments the loader asks jax (one process here).
    np.testing.assert_array_equal(Loader(rows, 8, seed=0).batch(2)["mask"], a.batch(2)["mask"])


def test_process_slices_make_the_global_batch(rng):
    rows = random_rows(rng)
    whole = Loader(rows, 8, seed=3, **one_process())
    parts = [Loader(rows, 8, seed=3, process_index=i, process_count=2) for i in range(2)]
    for step in (0, 7):
        for k in KEYS:
            halves = [p.batch(step)[k] for p in parts]
            assert halves[0].shape == (4, 8)
            np.testing.assert_array_equal(np.concatenate(halves), whole.batch(step)[k])
    evals = [data.eval_batches(rows, 8, 2, process_index=i, process_count=2) for i in range(2)]
    for k in KEYS:
        np.testing.assert_array_equal(
            np.concatenate([evals[0][1][k], evals[1][1][k]]), data.batch_of_rows(rows, np.arange(8, 16))[k]
        )


def test_state_and_restore_continue_exactly(rng):
    rows = random_rows(rng)
    loader = Loader(rows, 4, seed=5, **one_process())
    for _ in range(3):
        next(loader)
    state = json.loads(json.dumps(loader.state()))  # plain ints: any checkpointer stores it
    expected = [next(loader) for _ in range(4)]
    resumed = Loader(rows, 4, seed=5, **one_process())
    resumed.restore(state)
    for want, got in zip(expected, resumed):
        for k in KEYS:
            np.testing.assert_array_equal(got[k], want[k])
    assert resumed.step == loader.step == 7
    with pytest.raises(ValueError, match="seed=5 but this loader has seed=6"):
        Loader(rows, 4, seed=6, **one_process()).restore(state)


def test_epochs_visit_every_row_once(rng):
    rows = random_rows(rng)
    R = len(rows)
    assert R % 8  # so batches straddle epoch ends
    loader = Loader(rows, 8, seed=0, **one_process())
    indices = np.concatenate([loader.row_indices(s) for s in range(3 * R // 8 + 1)])
    epochs = [indices[e * R : (e + 1) * R] for e in range(3)]
    for e, epoch in enumerate(epochs):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(R))
        np.testing.assert_array_equal(epoch, np.random.default_rng((0, e)).permutation(R))
    assert not np.array_equal(epochs[0], epochs[1])


def test_batch_errors(rng):
    rows = random_rows(rng)
    with pytest.raises(ValueError, match="^global_batch=6 is not divisible by process_count=4$"):
        Loader(rows, 6, seed=0, process_index=0, process_count=4)
    few = data.pack([np.arange(1, 20)], seq_len=8, eos_id=0)
    with pytest.raises(ValueError, match="^the dataset has 2 rows, fewer than global_batch=8$"):
        Loader(few, 8, seed=0, **one_process())
    with pytest.raises(ValueError, match="fewer than 1 batch"):
        data.eval_batches(few, 8, **one_process())


# User data -----------------------------------------------------------------------------


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)


def test_directory_glob_and_jsonl(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.txt", "bee " * 50)
    write(root / "sub" / "a.md", "# Ay\n" * 30)
    write(root / "sub" / "bad.txt", b"caf\xe9\n")  # not UTF-8: decoded with U+FFFD
    write(root / ".git" / "HEAD", "ref: hidden")
    write(root / ".hidden.txt", "hidden")
    write(root / "blob.bin", b"\x89PNG\0\0\0binary")
    write(root / "empty.txt", "")
    cfg = data.DataConfig(path=str(root), val_fraction=0.0)
    docs = data.corpus(cfg)
    assert [d.name for d in docs] == ["b.txt", "sub/a.md", "sub/bad.txt"]
    assert docs[2].text == "caf\ufffd\n"
    assert data.documents(cfg, "train") == [d.text for d in docs]
    with pytest.raises(ValueError, match="the validation split is empty"):
        data.documents(cfg, "validation")

    glob_cfg = data.DataConfig(path=str(root / "**" / "*.md"))
    assert [d.name for d in data.corpus(glob_cfg)] == ["sub/a.md"]

    lines = [{"content": "first doc"}, {}, {"content": "third", "id": 3}, {"content": ""}]
    write(tmp_path / "d.jsonl", "\n".join(json.dumps(x) if x else "" for x in lines) + "\n")
    jsonl = data.DataConfig(path=str(tmp_path / "d.jsonl"), text_field="content")
    assert data.corpus(jsonl) == [("d.jsonl:1", "first doc"), ("d.jsonl:3", "third")]
    # By line: the split of a line is the split of its "file:line" name.
    assert data.split_of("d.jsonl:3", 0.5) == data.split_of("d.jsonl:3", 0.5)


def test_user_data_end_to_end(tmp_path):
    root = tmp_path / "corpus"
    for i in range(12):
        write(root / f"{i:02d}.txt", f"Document {i}. " + "the quick brown fox jumps. " * (10 + i))
    cfg = data.DataConfig(path=str(root), val_fraction=0.25)
    tok = data.load_tokenizer(cfg, 300, tmp_path / "cache")
    assert tok.get_vocab_size() <= 300
    data.check_vocab(tok, 300)  # a small corpus gives fewer tokens: padding to 384 allows it
    train = data.packed_rows(cfg, tok, 16, "train", tmp_path / "cache")
    val = data.packed_rows(cfg, tok, 16, "validation", tmp_path / "cache")
    assert len(train) > len(val) > 0
    text = tok.decode(train.tokens[0].tolist(), skip_special_tokens=False)
    assert text.startswith("Document 0. the quick")


def test_user_data_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files matched directory"):
        data.corpus(data.DataConfig(path=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="no files matched glob"):
        data.corpus(data.DataConfig(path=str(tmp_path / "*.nothing")))
    with pytest.raises(ValueError, match="no such file or directory"):
        data.corpus(data.DataConfig(path=str(tmp_path / "missing")))
    write(tmp_path / "blank" / "x.txt", "")
    with pytest.raises(ValueError, match="empty corpus"):
        data.corpus(data.DataConfig(path=str(tmp_path / "blank")))
    path = tmp_path / "bad.jsonl"
    write(path, '{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=f"^{path}:2: no 'text' field"):
        data.corpus(data.DataConfig(path=str(path)))
    write(path, '{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=f"^{path}:2: 'text' is int"):
        data.corpus(data.DataConfig(path=str(path)))
    write(path, '{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=f"^{path}:2: invalid JSON"):
        data.corpus(data.DataConfig(path=str(path)))


# The model sees the packing ------------------------------------------------------------


@pytest.mark.slow
def test_segment_ids_isolate_documents_in_attention(rng):
    cfg = ModelConfig(vocab_size=64, dim=32, layers=1, heads=2, kv_heads=1, head_dim=16, mlp_dim=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    first, second = rng.integers(1, 64, 5), rng.integers(1, 64, 6)
    rows = data.pack([first, second], seq_len=12, eos_id=0)  # exactly one row
    (batch,) = data.eval_batches(rows, 1, 1, **one_process())
    assert batch["segment_ids"][0].tolist() == [1] * 6 + [2] * 6
    forward = nnx.jit(lambda m, tokens, **kw: m(tokens, **kw))
    packing = {k: batch[k] for k in ("positions", "segment_ids")}
    packed = forward(model, batch["inputs"], **packing)
    alone = forward(model, second[None].astype(np.int32))
    assert rel_err(packed[0, 6:], alone[0]) < 1e-5
    # Without the packing metadata the second document would see the first.
    leaky = forward(model, batch["inputs"])
    assert rel_err(leaky[0, 6:], alone[0]) > 1e-3
