"""Hugging Face Llama import/export: logits parity with transformers in float32."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import jaxpar
from jaxpar.models import PRESETS, RopeScaling, Transformer
from jaxpar.models.hf import from_hf, to_hf
from jaxpar.models.transformer import rope_frequencies


def hf_modules():
    """``(torch, transformers)``, imported where a test first needs them: at the top of
    this file they cost every pytest worker about 7 s of its collection, whether or not
    it runs this file."""
    import torch
    import transformers

    return torch, transformers


TINY = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
}
TOKENS = np.random.RandomState(0).randint(0, TINY["vocab_size"], size=(2, 12))


def hf_model(**overrides):
    """A tiny random Llama; norm weights are noise around 1, so a swapped norm shows."""
    torch, transformers = hf_modules()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn_like(p)
            p.copy_(1 + noise if "norm" in name else noise)
    return model.eval()


def hf_logits(model) -> np.ndarray:
    torch, _ = hf_modules()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def from_hf_of(hf, tmp_path):
    """Saves ``hf`` under tmp_path/src and loads it back with from_hf."""
    hf.save_pretrained(tmp_path / "src", safe_serialization=True)
    return from_hf(tmp_path / "src")


def assert_close(ours, ref, tol=1e-4):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() / np.abs(ref).max() < tol


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny HF checkpoint and its logits."""
    model, path = hf_model(), tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, safe_serialization=True)
    return path, hf_logits(model)


def copy_of(checkpoint, tmp_path):
    shutil.copytree(checkpoint[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_parameters": LLAMA3_ROPE},
        {"attention_bias": True, "mlp_bias": True},
    ],
    ids=["untied", "tied", "llama3_rope", "biases"],
)
def test_logits_match_transformers(overrides, tmp_path):
    model = hf_model(**overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ours = from_hf(tmp_path)
    assert ours.cfg.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert ours.cfg.attention_bias == ours.cfg.mlp_bias == overrides.get("mlp_bias", False)
    if "rope_parameters" in overrides:  # the scaling must matter at these lengths
        assert ours.cfg.rope_scaling is not None
        plain = dataclasses.replace(ours.cfg, rope_scaling=None)
        assert not np.allclose(rope_frequencies(ours.cfg), rope_frequencies(plain))
    assert_close(ours(jnp.asarray(TOKENS)), hf_logits(model))


def test_sharded_checkpoint(tmp_path):
    model = hf_model()
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_close(from_hf(tmp_path)(jnp.asarray(TOKENS)), hf_logits(model))


def test_placed_on_mesh(checkpoint):
    path, ref = checkpoint
    model = from_hf(path, mesh=jaxpar.make_mesh(fsdp=8))
    embed = model.embed[...]
    assert "fsdp" in embed.sharding.spec and len(embed.sharding.device_set) == 8
    assert embed.addressable_shards[0].data.shape == (128, 64 // 8)
    assert_close(model(jnp.asarray(TOKENS)), ref)


def test_pre_transformers_5_rope_config(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    config.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    (path / "config.json").write_text(json.dumps(config))
    cfg = from_hf(path).cfg
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, original_max_position=8)


def test_bfloat16(checkpoint):
    path, ref = checkpoint
    model = from_hf(path, dtype=jnp.bfloat16)
    assert model.cfg.dtype == model.cfg.param_dtype == "bfloat16"
    assert model.layers.attn.q[...].dtype == jnp.bfloat16
    assert_close(model(jnp.asarray(TOKENS)), ref, tol=5e-2)


def test_round_trip(tmp_path):
    _, transformers = hf_modules()
    model = from_hf_of(hf_model(attention_bias=True, rope_parameters=LLAMA3_ROPE), tmp_path)
    out = tmp_path / "out"
    to_hf(model, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert_close(model(jnp.asarray(TOKENS)), hf_logits(reloaded))
    assert_close(from_hf(out)(jnp.asarray(TOKENS)), hf_logits(reloaded), tol=1e-6)

    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="already holds config.json, model.safetensors"):
        to_hf(model, out)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before

    to_hf(model, out, dtype="bfloat16", overwrite=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert_close(from_hf(out)(jnp.asarray(TOKENS)), hf_logits(reloaded), tol=5e-2)


def test_to_hf_refuses_gpt2_style(tmp_path):
    cfg = dataclasses.replace(PRESETS["gpt2"], vocab_size=128, dim=64, layers=1, heads=4,
                              kv_heads=4, head_dim=16, mlp_dim=96, max_position=16)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="Llama models only.*'norm': 'layer'"):
        to_hf(model, tmp_path)
    assert not list(tmp_path.iterdir())


# Bad input: one clear error each ----------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory .*nowhere does not exist"):
        from_hf(tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match="directory .*file is not a directory"):
        from_hf(tmp_path / "file")


def test_missing_config(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        from_hf(path)


def test_unsupported_architecture(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    match = "unsupported architecture.*GPT2LMHeadModel.*only LlamaForCausalLM"
    with pytest.raises(ValueError, match=match):
        from_hf(path)


def test_unsupported_rope(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="RoPE .*yarn.*only 'default' and 'llama3'"):
        from_hf(path)


def test_pickle_only(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    match = r"no \*.safetensors.*pytorch_model.bin.*not loaded"
    with pytest.raises(FileNotFoundError, match=match):
        from_hf(path)


def test_missing_shard(tmp_path):
    hf_model().save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard {shard.name}, which is not in"):
        from_hf(tmp_path)


def test_missing_and_misshapen_tensors(checkpoint, tmp_path):
    path = copy_of(checkpoint, tmp_path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    tensors["model.layers.0.extra.weight"] = np.zeros((4,), np.float32)
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match its config.json: missing tensors") as e:
        from_hf(path)
    message = str(e.value)
    assert "\n" not in message and "unexpected tensors: model.layers.0.extra.weight" in message
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.norm.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight expected (32, 64), found (16, 64)" in message


# Where generation stops -------------------------------------------------------------


def test_generate_stops_where_transformers_stops(tmp_path, capsys):
    """jaxpar-generate on a Hugging Face export of a tiny jaxpar model stops at
    generation_config.json's eos_token_id (a list, as Llama 3 has) exactly where
    transformers' greedy generate stops; without that file, config.json's id, then
    tokenizer_config.json's eos_token name the end."""
    torch, transformers = hf_modules()
    import tokenizers
    from conftest import random_init

    from jaxpar.models import ModelConfig
    from jaxpar.commands.generate import main as generate
    from jaxpar.train.runs import eos_ids

    cfg = ModelConfig(vocab_size=128, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=96)
    path = tmp_path / "hf"
    to_hf(random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), np.random.default_rng(1)), path)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(128)}, "t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(path / "tokenizer.json"))
    prompt = [5, 17, 42, 9]

    def hf_greedy():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    free = hf_greedy()  # no end token anywhere yet
    assert len(free) == 12 and eos_ids(path, words) == ()
    stop = next(i for i in range(3, 12) if free[i] not in free[:i])  # the end, first seen there
    unused = next(i for i in range(128) if i not in free)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, free[stop]]}))
    assert hf_greedy() == free[: stop + 1]
    assert generate([str(path), "--prompt", " ".join(f"t{i}" for i in prompt),
                     "--max-new-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == free[: stop + 1]

    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 3}))
    assert eos_ids(path, words) == (3,)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "t7"}}))
    assert eos_ids(path, words) == (7,)
