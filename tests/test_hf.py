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


# Mixtral, Qwen3-MoE and Qwen3 ----------------------------------------------------------

# Tiny float32 shapes: 2 layers, 4 experts, top-2, GQA (4 heads over 2).
TINY_MOE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=24, num_experts_per_tok=2)
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=False, attention_bias=True)),
}
MOE_TOKENS = np.random.RandomState(1).randint(0, TINY_MOE["vocab_size"], size=(2, 10))


def hf_of(arch, **overrides):
    """A tiny random transformers model of ``arch`` (``ARCHS``): noise of 0.1 (norm
    weights around 1), so routers choose by clear margins and a swapped tensor shows."""
    torch, transformers = hf_modules()
    config, model, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = getattr(transformers, model)(getattr(transformers, config)(**{**TINY_MOE, **extra, **overrides}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return hf.eval()


def logits_of(hf, tokens=MOE_TOKENS) -> np.ndarray:
    torch, _ = hf_modules()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


def assert_rel(ours, ref, tol=1e-5):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape and np.abs(ours - ref).max() / np.abs(ref).max() < tol


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """``arch -> (saved directory, transformers' logits, its model, our import)``: one
    tiny model per architecture, made where a test first asks, for the tests below."""
    made = {}

    def get(arch):
        if arch not in made:
            hf, path = hf_of(arch), tmp_path_factory.mktemp(arch)
            hf.save_pretrained(path, safe_serialization=True)
            made[arch] = path, logits_of(hf), hf, from_hf(path)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_logits_match_transformers(arch, moe_checkpoint):
    """Float32 logits within 1e-5 relative (measured: 3.9e-7 Mixtral, 3.2e-7 Qwen3-MoE)."""
    _, ref, _, ours = moe_checkpoint(arch)
    moe = ours.cfg.moe
    assert (moe.experts, moe.experts_per_token, ours.cfg.qk_norm) == (4, 2, arch == "qwen3_moe")
    assert moe.normalize == (arch == "mixtral") and ours.cfg.attention_bias == (arch == "qwen3_moe")
    assert_rel(ours(jnp.asarray(MOE_TOKENS)), ref)


def test_qwen3_moe_greedy_decode_matches_transformers(moe_checkpoint):
    """Plain greedy decoding (jaxpar.inference, KV-cached prefill then one token a step)
    gives transformers' greedy generate's tokens. Qwen3-MoE's model is Mixtral's plus q/k
    norms, attention biases and unnormalised gates, so it alone is decoded (about 5
    CPU-seconds of compiling each)."""
    torch, _ = hf_modules()
    from jaxpar.inference.decoding import generate

    _, _, hf, ours = moe_checkpoint("qwen3_moe")
    prompt, new = MOE_TOKENS[:, :6], 5
    expected = hf.generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False, pad_token_id=0)
    tokens = np.stack(list(generate(ours, prompt, max_new_tokens=new)), axis=1)
    np.testing.assert_array_equal(tokens, expected[:, prompt.shape[1]:].numpy())


@pytest.mark.slow
def test_serve_mixtral_expert_and_tensor_parallel_matches_transformers(moe_checkpoint, tmp_path):
    """``jaxpar-serve MIXTRAL_DIR mesh.expert=2 mesh.tensor=2`` (paged KV cache; the
    experts split over ``expert``, each device running its own over every token, their
    width and attention's heads over ``tensor``) answers the official openai client with transformers' greedy generate's
    tokens, cut at Mixtral's end token (id 2) where generate stops. One program (steps of
    8 tokens): a word-level tokenizer ``t0`` ... ``t63`` is added to the saved directory."""
    import openai
    import tokenizers
    from test_serve import start

    from jaxpar.commands import serve

    torch, _ = hf_modules()
    src, _, hf, _ = moe_checkpoint("mixtral")
    path = shutil.copytree(src, tmp_path / "mixtral")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(64)}, "t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(path / "tokenizer.json"))
    args = serve._parser().parse_args([str(path), "mesh.expert=2", "mesh.tensor=2", "--max-batch", "2", "--page-size", "8",
                                       "--max-num-batched-tokens", "8", "--max-context", "32",
                                       "--kv-memory", str(16 * 2 * 2 * 8 * 2 * 8 * 4), "--wait-for-programs"])
    async_engine, app, engine = serve.build(args)
    assert dict(engine.mesh.shape) == {"expert": 2, "tensor": 2} and len(engine.compiled_programs) == 2
    assert engine.params["layers"]["moe"]["up"].sharding.spec[1] == "expert"  # [L, E, D, F]: E split
    server, thread, url = start(app)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for prompt in MOE_TOKENS[:, :6].tolist():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            want = out[0, len(prompt):].tolist()
            got = client.completions.create(model="mixtral", prompt=" ".join(f"t{i}" for i in prompt),
                                            max_tokens=12, temperature=0)
            assert got.usage.completion_tokens == len(want)
            assert got.choices[0].text == " ".join(f"t{i}" for i in want if i != 2)
    finally:
        server.should_exit = True
        thread.join(60)
    assert not thread.is_alive()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_export_is_the_hub_layout(arch, moe_checkpoint, tmp_path):
    """to_hf writes the tensor names and shapes transformers' save_pretrained writes (the
    Hub's per-expert layout) and the Hub's config keys; transformers reloads it with our
    logits; an export of an import gives the source's tensors exactly."""
    _, transformers = hf_modules()
    src, ref, _, ours = moe_checkpoint(arch)
    to_hf(ours, tmp_path)
    source, written = (safetensors.numpy.load_file(d / "model.safetensors") for d in (src, tmp_path))
    assert sorted(written) == sorted(source)
    assert all(np.array_equal(written[k], source[k]) for k in source)
    config = json.loads((tmp_path / "config.json").read_text())
    experts_key = "num_local_experts" if arch == "mixtral" else "num_experts"
    assert config["architectures"] == [ARCHS[arch][1]] and config[experts_key] == 4
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == ARCHS[arch][1]
    assert_rel(logits_of(reloaded), ref)


def test_qwen3_moe_sparse_step_and_dense_qwen3(tmp_path):
    """Qwen3-MoE with decoder_sparse_step=2 (layer 0 dense, layer 1 MoE: jaxpar's
    model.moe.every=2) and dense Qwen3 (q/k norms, no experts): logits equal
    transformers', and the export is the source's tensors."""
    _, transformers = hf_modules()
    stepped = hf_of("qwen3_moe", decoder_sparse_step=2, attention_bias=False)
    torch_dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{k: v for k, v in TINY_MOE.items() if k != "num_experts_per_tok"}, tie_word_embeddings=True))
    for name, hf in [("stepped", stepped), ("dense", torch_dense)]:
        if name == "dense":
            hf = hf.eval()
        hf.save_pretrained(tmp_path / name, safe_serialization=True)
        ours = from_hf(tmp_path / name)
        assert ours.cfg.qk_norm and (ours.cfg.moe is None) == (name == "dense")
        assert name == "dense" or ours.cfg.moe.every == 2
        assert_rel(ours(jnp.asarray(MOE_TOKENS)), logits_of(hf))
        to_hf(ours, tmp_path / f"{name}_out")
        source, written = (safetensors.numpy.load_file(tmp_path / d / "model.safetensors")
                           for d in (name, f"{name}_out"))
        assert sorted(written) == sorted(source) and all(np.array_equal(written[k], source[k]) for k in source)


@pytest.mark.parametrize("arch, change, message", [
    ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]; only \[\] is read"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true; jaxpar's attention has no sliding window"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window=4096; jaxpar's attention has no sliding window"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1; jaxpar's router has no jitter"),
    ("mixtral", {"num_experts_per_tok": 5}, "model.moe.experts_per_token=5 is more than model.moe.experts=4"),
])
def test_unsupported_moe_config_is_one_line(arch, change, message, tmp_path):
    config = {"architectures": [ARCHS[arch][1]], **TINY_MOE, **ARCHS[arch][2], **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file({"x": np.ones(1, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message) as e:
        from_hf(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_to_hf_refuses_moe_it_cannot_write(tmp_path):
    base = dataclasses.replace(PRESETS["moe_tiny"], vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2,
                               head_dim=8, mlp_dim=24)
    for change, message in [
        (dict(router="sigmoid_bias"), "as MixtralForCausalLM: model.moe.router='sigmoid_bias' \\(only 'softmax'\\)"),
        (dict(shared_experts=1), "model.moe.shared_experts=1 \\(only 0\\)"),
        (dict(every=2), "model.moe.every=2, normalize=True \\(Mixtral: 1, true; with model.qk_norm"),
    ]:
        cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, **change))
        with pytest.raises(ValueError, match=message):
            to_hf(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), tmp_path)
    assert not list(tmp_path.iterdir())


def test_generate_refuses_an_unsupported_moe_config_with_exit_2(tmp_path, capsys):
    """jaxpar-generate on a Qwen3-MoE directory with mlp_only_layers: exit 2, one line."""
    import tokenizers

    from jaxpar.commands.generate import main as generate

    config = {"architectures": ["Qwen3MoeForCausalLM"], **TINY_MOE, **ARCHS["qwen3_moe"][2], "mlp_only_layers": [1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file({"x": np.ones(1, np.float32)}, tmp_path / "model.safetensors")
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, "a")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(SystemExit) as e:
        generate([str(tmp_path), "--prompt", "a"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and r"mlp_only_layers=[1]; only [] is read" in err
