"""Self-distilled GliDe training rows (jaxpar.train.self_distill): the target's own greedy
continuations of each document's first tokens. The run through jaxpar-train glide is in
test_glide.py (test_a_self_distilled_draft_trains_on_the_targets_continuations)."""

import json
import pathlib
import re
import runpy

import numpy as np
import pytest
import tokenizers
from flax import nnx

from conftest import random_init
from jaxpar.inference.decoding import generate
from jaxpar.models import ModelConfig, Transformer
from jaxpar.train import data, self_distill
from jaxpar.train.config import load_config

CFG = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48, init_std=0.3)


def greedy(model, prompt, n):
    """The target's plain greedy decoding of one prompt: ``n`` tokens, one step at a time."""
    stream = generate(model, np.asarray(prompt)[None], max_new_tokens=n)
    return np.asarray([int(t[0]) for t in stream])


@pytest.mark.slow
def test_rows_are_each_prompt_and_the_targets_greedy_continuation(rng, tmp_path):
    """Prompts of seven lengths (one twice) in batches of three (the last padded, each
    generating for its shortest prompt): every row is its prompt and then the target's
    plain greedy decoding of it, in the prompts' order, one segment at positions
    0..seq_len. Rows are stored by prompt: a build that lost one batch's file generates
    that batch alone, and more prompts generate only the new ones."""
    target = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), rng)
    cfg = load_config("glide", ["target_run_dir=t", "seq_len=16", "glide.generate_batch=3"])
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    lengths = [3, 12, 5, 1, 9, 12, 7]
    prompt_list = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in lengths]
    prompt_list.append(prompt_list[2])

    rows = self_distill.generated_rows(cfg, target, tokenizer, prompt_list, tmp_path, "params")
    width = cfg.seq_len + 1
    assert rows.tokens.shape == (len(prompt_list), width)
    for prompt, row in zip(prompt_list, rows.tokens):
        assert np.array_equal(row[:len(prompt)], prompt)
        assert np.array_equal(row[len(prompt):], greedy(target, prompt, width - len(prompt)))
    assert (rows.segment_ids == 1).all() and (rows.positions == np.arange(width)).all()
    batch = data.batch_of_rows(rows, np.arange(len(prompt_list)))
    assert batch["mask"].all()  # one document a row: every next token counts

    directory = self_distill.store_directory(tmp_path, "params", tokenizer, width)
    files = sorted(directory.iterdir())
    assert len(files) == 3  # seven distinct prompts, three a batch
    before = {f.name: f.stat().st_mtime_ns for f in files}
    files[1].unlink()
    again = self_distill.generated_rows(cfg, target, tokenizer, prompt_list, tmp_path, "params")
    assert np.array_equal(again.tokens, rows.tokens)
    after = {f.name: f.stat().st_mtime_ns for f in directory.iterdir()}
    assert after.keys() == before.keys()
    assert [name for name in before if after[name] != before[name]] == [files[1].name]

    more = [rng.integers(0, CFG.vocab_size, 4).astype(np.int32) for _ in range(2)]
    grown = self_distill.generated_rows(cfg, target, tokenizer, prompt_list + more, tmp_path, "params")
    assert np.array_equal(grown.tokens[:len(prompt_list)], rows.tokens)
    assert len(list(directory.iterdir())) == 4  # one more batch: the two new prompts
    assert (grown.tokens[-2:, :4] == more).all()
    # Another target (its parameters' fingerprint) stores its rows apart.
    assert self_distill.store_directory(tmp_path, "other", tokenizer, width) != directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSON-lines corpus of prompts (three long, one short, the rest between) and the
    byte-level BPE a run would train on it."""
    root = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(1)
    words = ["def", "return", "self", "value", "the", "import", "class", "print", "(", ")", ":", "\n    "]
    texts = [" ".join(rng.choice(words, n)) for n in [2000, 2000, 2000, 3, *rng.integers(20, 60, 36)]]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = load_config("glide", ["target_run_dir=t", f"data.path={root / 'prompts.jsonl'}",
                                "data.val_fraction=0.25", "glide.prompt_tokens=24"])
    return cfg, data.load_tokenizer(cfg.data, 300, root / "cache"), texts


def test_prompts_are_each_documents_first_tokens(corpus):
    cfg, tokenizer, texts = corpus
    docs = data.split_documents(cfg.data, "train")
    assert 10 < len(docs) < len(texts)
    found = self_distill.prompts(cfg, tokenizer, "train")
    assert len(found) == len(docs)
    for doc, prompt in zip(docs, found):
        assert np.array_equal(prompt, tokenizer.encode(doc.text).ids[:24])
    long = next(d for d in docs if len(d.text) > 16 * 32)  # tokenized from a prefix of it
    assert len(tokenizer.encode(long.text).ids) > 24 and long.text in texts[:3]
    spread = self_distill.prompts(cfg, tokenizer, "train", 4)
    n = len(found)
    assert [p.tolist() for p in spread] == [found[i * n // 4].tolist() for i in range(4)]
    with pytest.raises(ValueError, match=re.escape(f"glide.train_rows=999 exceeds the train split's {n} documents")):
        self_distill.prompts(cfg, tokenizer, "train", 999)


def test_first_tokens_of_a_text_of_long_tokens():
    """A text whose tokens are longer than the prefix allows for (here one character
    repeated, which BPE merges into long tokens) is tokenized whole."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tokenizer.train_from_iterator(["a" * 4096] * 4, trainer=trainer)
    text = "a" * 40_000
    assert np.array_equal(self_distill.first_tokens(tokenizer, text, 5), tokenizer.encode(text).ids[:5])
    assert len(self_distill.first_tokens(tokenizer, "aa", 5)) == len(tokenizer.encode("aa").ids) < 5


def test_glide_prompts_code_windows_start_at_line_starts():
    """bench/glide_prompts.py's later code windows: from the first line after every
    ``chars`` characters, and none where too little text is left; the start always."""
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "glide_prompts.py"
    window = runpy.run_path(str(script), run_name="glide_prompts")["code_window"]
    text = "".join(f"line {i:03d} of the file\n" for i in range(100))  # 21 characters a line
    assert window(text, 0, 300) == text[:300]
    second = window(text, 1, 300, min_chars=100)
    assert second.startswith("line 015 ") and len(second) == 300  # line 14 starts at 294, line 15 at 315
    assert window(text, 6, 300, min_chars=100).startswith("line 086 ")  # from 1,806 of 2,100: 294 left
    assert window(text, 6, 300, min_chars=295) is None
    assert window(text, 7, 300) is None  # no line starts after 2,100
    assert window("short", 0, 300) == "short"
