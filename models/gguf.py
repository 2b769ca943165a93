"""GGUF files (llama.cpp's format) -> jaxpar ``Transformer`` and ``tokenizers.Tokenizer``.

A GGUF file holds the weights, the model's hyperparameters and its tokenizer as metadata.
Read with the ``gguf`` package (llama.cpp's own reader), Llama architecture only
(``general.architecture == "llama"``).

Weights. Tensors are dequantized to float32 on the host (``gguf.quants.dequantize``);
types read: F32, F16, BF16, Q8_0, Q4_0, Q4_1. A ggml tensor of ``ne = [in, out]`` is a
numpy ``[out, in]`` array: Hugging Face's ``nn.Linear`` layout, so each tensor is renamed
to its Hugging Face name (``_HF_NAMES``) and the layout ``models/hf.py`` documents
(``TABLES``) does the rest. One difference: llama.cpp's converter
(``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows of q and k (weights
and biases) within each head from rotate-half order ``[2, H/2]`` to interleaved pairs
``[H/2, 2]`` for its RoPE; ``_unpermute`` puts them back, so the model is the Hugging Face
one (our RoPE is rotate-half too).

Config. From the metadata: ``llama.embedding_length``, ``block_count``,
``attention.head_count(_kv)``, ``attention.key_length`` (head dim, default dim/heads),
``feed_forward_length``, ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``,
``context_length`` (``max_position``), the vocabulary size (``llama.vocab_size``, else
the embedding's rows); embeddings are tied when there is no ``output.weight``.
RoPE scaling (``rope.scaling.type`` or a ``rope_freqs.weight`` tensor: Llama 3.1's) is
refused.

Tokenizer. ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, as Llama 3, SmolLM, Qwen
write it): the file's tokens (already in the byte-level alphabet), merges and token types
(3, control: special tokens; 4, user-defined: added tokens) become a Hugging Face
``tokenizers.Tokenizer``. Text is split before BPE as ``tokenizer.ggml.pre`` names
(``_PRE_TOKENIZERS``: GPT-2's split, or digits one by one first, as SmolLM's).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re

import numpy as np

from jaxpar.models.config import ModelConfig
from jaxpar.models.hf import config_from_dict, load_tensors
from jaxpar.models.transformer import Transformer

# ggml type name -> dequantized by gguf.quants.dequantize (Q8_0: int8 x one f16 scale per
# 32; Q4_0: 4-bit x scale; Q4_1: 4-bit x scale + minimum). Other types are refused rather
# than read untested.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# llama.cpp's tensor names (gguf.constants.TENSOR_NAMES) -> Hugging Face's.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor ``name``; an unknown name stays as it is (and
    is then reported as an unexpected tensor)."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        block, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{block}.{_BLOCK_NAMES[part]}.{kind}"
    if (m := re.fullmatch(r"(\w+)\.(weight|bias)", name)) and m[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m[1]]}.{m[2]}"
    return name


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's ``LlamaModel.permute`` of q or k: ``w`` ``[heads * H, ...]``
    (a weight ``[heads * H, D]`` or a bias ``[heads * H]``), its rows within each head
    stored as ``[H/2, 2]``, returned as ``[2, H/2]`` (rotate-half order), same shape."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int):
    """A ``gguf.GGUFReader`` of ``path`` (memory-mapped), cached per file version:
    ``jaxpar-generate`` reads the tokenizer, the model and the end tokens from one file,
    and parsing the vocabulary takes seconds."""
    import gguf

    class Reader(gguf.GGUFReader):
        """``gguf.GGUFReader`` over a plain array view of its memory map: it reads the
        header an element at a time (SmolLM2's 49,152-token vocabulary and its merges, a
        quarter of a million slices), and a ``np.memmap`` slice costs numpy's subclass
        hooks each time (the one conversion of SmolLM2's file: 5.9 -> 3.1 s, 2026-11-28)."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)

    try:
        return Reader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def _reader(path):
    path = pathlib.Path(path)
    if not path.is_file():
        why = "is not a file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"GGUF file {path} {why}")
    stat = path.stat()
    return _open(str(path), stat.st_mtime_ns, stat.st_size)


def _field(reader, key: str, default=None):
    """Metadata value ``key`` (a str, number or list), ``default`` if absent."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _check_llama(reader, path) -> None:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r}; only 'llama' GGUF files are read")


def _decimal(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: the value the
    converter read (1e-05, not 9.999999747378752e-06), as a Hugging Face config has it."""
    return float(str(np.float32(x)))


def _config(reader, path, tensors: dict) -> ModelConfig:
    """The model config of the metadata, as a Hugging Face config dict read by
    ``models.hf.config_from_dict`` (the same checks and defaults as ``from_hf``)."""
    return config_from_dict(_hf_config(reader, path, tensors), f"{path} (its metadata)")


def _hf_config(reader, path, tensors: dict) -> dict:
    """The metadata as a Hugging Face Llama ``config.json`` (ValueError where jaxpar
    cannot read it)."""
    get = functools.partial(_field, reader)
    required = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
    if missing := [f"llama.{k}" for k in required if not isinstance(get(f"llama.{k}"), int)]:
        raise ValueError(f"{path} lacks integer metadata {', '.join(missing)}")
    dim, heads = get("llama.embedding_length"), get("llama.attention.head_count")
    head_dim = get("llama.attention.key_length", dim // heads)
    if (rotary := get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: llama.rope.dimension_count={rotary} rotates part of each "
                         f"head ({head_dim}); only whole-head RoPE is supported")
    scaling = get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        what = f"llama.rope.scaling.type={scaling!r}" if scaling != "none" else "rope_freqs.weight"
        raise ValueError(f"{path}: RoPE scaling ({what}) is not supported")
    embed = tensors.get("token_embd.weight")
    vocab = get("llama.vocab_size", None if embed is None else int(embed.shape[-1]))
    hf = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": dim, "num_attention_heads": heads,
        "num_hidden_layers": get("llama.block_count"),
        "num_key_value_heads": get("llama.attention.head_count_kv", heads), "head_dim": head_dim,
        "intermediate_size": get("llama.feed_forward_length"), "vocab_size": vocab,
        "rms_norm_eps": _decimal(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _decimal(get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": get("llama.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
    }
    config_from_dict(hf, f"{path} (its metadata)")  # its checks
    return hf


def _dequantize(tensor) -> np.ndarray:
    """float32 numpy array of a ``gguf.ReaderTensor``, ``[out, in]`` for a matrix."""
    from gguf.quants import dequantize

    w = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(w, np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


def from_gguf(path, *, dtype="float32", mesh=None, rules=None) -> Transformer:
    """Builds a ``Transformer`` from a llama.cpp GGUF file of a Llama model.

    Args:
      path: the ``.gguf`` file.
      dtype: compute and parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
        quantized tensors are dequantized to float32 first, then cast.
      mesh, rules: as in ``from_hf``: the model is placed by ``jaxpar.shard_model``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, not a Llama, an unsupported tensor type or config, or
        tensors missing, unexpected or misshapen.
    """
    cfg, tensors, read = _weights(path)
    return load_tensors(cfg, tensors, read, dtype=dtype, mesh=mesh, rules=rules,
                        mismatch=f"{path} does not match its metadata")


def _weights(path):
    """``(config, Hugging Face tensor names, read)``: ``read(name)`` the float32 numpy
    array of a tensor, dequantized and in Hugging Face's layout."""
    reader = _reader(path)
    _check_llama(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if bad := [t for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TYPES]:
        raise ValueError(f"{path}: tensor {bad[0].name} is {bad[0].tensor_type.name} "
                         f"({len(bad)} such tensors); from_gguf reads {', '.join(SUPPORTED_TYPES)}")
    cfg = _config(reader, path, tensors)
    by_hf = {_hf_name(name): t for name, t in tensors.items()}
    heads = {"q_proj": cfg.heads, "k_proj": cfg.kv_heads}

    def read(name: str) -> np.ndarray:
        w = _dequantize(by_hf[name])
        proj = name.split(".")[-2]
        return _unpermute(w, heads[proj]) if proj in heads else w

    return cfg, by_hf, read


def save_as_hf(path, out) -> None:
    """Writes GGUF file ``path`` as a Hugging Face directory ``out`` (which must not
    exist yet): ``config.json``, ``model.safetensors`` (float32, Hugging Face's names and
    layout), ``tokenizer.json``, ``generation_config.json`` (the end tokens) and
    ``tokenizer_config.json`` (BOS and EOS tokens, the chat template). ``from_hf`` then
    reads the same model ``from_gguf`` does, in a fraction of the time: the file's
    metadata (the vocabulary above all) takes seconds to parse and its tensors to
    dequantize."""
    import json

    from safetensors.numpy import save_file

    out = pathlib.Path(out)
    out.mkdir(parents=True)
    reader = _reader(path)
    _, tensors, read = _weights(path)
    (out / "config.json").write_text(json.dumps(_hf_config(reader, path, {t.name: t for t in reader.tensors})))
    save_file({name: np.ascontiguousarray(read(name)) for name in tensors}, str(out / "model.safetensors"))
    tokenizer, meta = gguf_tokenizer(path), gguf_metadata(path)
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(meta.eos_ids)}))
    special = {name: tokenizer.id_to_token(i) for name, i in
               (("bos_token", meta.bos_id), ("eos_token", (meta.eos_ids or (None,))[0])) if i is not None}
    (out / "tokenizer_config.json").write_text(json.dumps({**special, "chat_template": meta.chat_template}))


# tokenizer.ggml.pre -> what splits text before BPE (llama.cpp's llama-vocab.cpp regexes).
# GPT-2's split is ByteLevel's own regex; llama.cpp's "smollm" family puts "\p{N}" (every
# digit alone) before it, as SmolLM's tokenizer.json does with Digits(individual_digits).
_GPT2_PRE = ("gpt-2", "gpt2", None)  # None: files older than the key, read as GPT-2's
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell")
_PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_PRE


def _pre_tokenizer(pre: str | None, path):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    known = ", ".join(repr(p) for p in _PRE_TOKENIZERS if p)
    raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported (known: {known})")


def gguf_tokenizer(path):
    """The file's byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as a
    ``tokenizers.Tokenizer``: control tokens special, user-defined tokens added whole, and
    the BOS token prepended where ``tokenizer.ggml.add_bos_token`` says so.

    Raises:
      ValueError: another tokenizer model (sentencepiece ``"llama"`` and others) or an
        unknown ``tokenizer.ggml.pre``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    reader = _reader(path)
    if (kind := _field(reader, "tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}; only 'gpt2' (byte-level BPE) "
                         "tokenizers are read")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [])
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"), path)
    tokenizer.decoder = decoders.ByteLevel()
    control, user = 3, 4  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL, _USER_DEFINED
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k == control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types) if k == user])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return tokenizer


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """What generation needs from a GGUF file besides the model and the tokenizer.

    Attributes:
      eos_ids: the tokens that end generation, as llama.cpp stops: ``tokenizer.ggml``'s
        ``eos_token_id``, ``eot_token_id`` and ``eom_token_id`` (those present).
      bos_id: ``tokenizer.ggml.bos_token_id`` or None.
      chat_template: ``tokenizer.chat_template`` (Jinja, as Hugging Face's) or None.
      context_length: ``llama.context_length`` or None.
    """

    eos_ids: tuple[int, ...]
    bos_id: int | None
    chat_template: str | None
    context_length: int | None


def gguf_metadata(path) -> GGUFMetadata:
    """The end tokens, BOS token, chat template and context length of a GGUF file."""
    reader = _reader(path)
    ends = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return GGUFMetadata(
        eos_ids=tuple(dict.fromkeys(i for i in ends if i is not None)),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        context_length=_field(reader, f"{_field(reader, 'general.architecture')}.context_length"),
    )


def is_gguf(path) -> bool:
    """Whether ``path`` is a file named ``*.gguf``."""
    return os.fspath(path).endswith(".gguf") and pathlib.Path(path).is_file()
