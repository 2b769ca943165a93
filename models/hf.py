"""Hugging Face Llama checkpoints <-> jaxpar ``Transformer``.

Reads and writes a local directory holding ``config.json`` and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``). Pickle ``*.bin`` files are never
loaded. Only the Llama architecture (``LlamaForCausalLM``) maps onto the model:
``norm="rms", mlp="swiglu", position="rope"``.

Layout. HF ``nn.Linear`` weights are ``[out, in]``, ours ``[in, ..., out]``. HF's per-layer
tensors ``model.layers.{i}.<name>`` are stacked on our leading ``L`` axis.

  ours                    shape         HF <name>                        shape    ours <- W
  embed                   [V, D]        model.embed_tokens.weight        [V, D]   W
  layers.attn.q           [L, D, N, H]  self_attn.q_proj.weight          [N*H, D] W.T -> D,N,H
  layers.attn.k, v        [L, D, K, H]  self_attn.k_proj, v_proj.weight  [K*H, D] W.T -> D,K,H
  layers.attn.o           [L, N, H, D]  self_attn.o_proj.weight          [D, N*H] W.T -> N,H,D
  layers.mlp.gate, up     [L, D, F]     mlp.gate_proj, up_proj.weight    [F, D]   W.T
  layers.mlp.down         [L, F, D]     mlp.down_proj.weight             [D, F]   W.T
  layers.attn_norm.scale  [L, D]        input_layernorm.weight           [D]      W
  layers.mlp_norm.scale   [L, D]        post_attention_layernorm.weight  [D]      W
  final_norm.scale        [D]           model.norm.weight                [D]      W
  lm_head                 [D, V]        lm_head.weight (untied only)     [V, D]   W.T
  layers.attn.q_bias      [L, N, H]     self_attn.q_proj.bias            [N*H]    W -> N,H
  layers.attn.k/v_bias    [L, K, H]     self_attn.k_proj, v_proj.bias    [K*H]    W -> K,H
  layers.attn.o_bias      [L, D]        self_attn.o_proj.bias            [D]      W
  layers.mlp.gate/up_bias [L, F]        mlp.gate_proj, up_proj.bias      [F]      W
  layers.mlp.down_bias    [L, D]        mlp.down_proj.bias               [D]      W

Biases exist with ``attention_bias`` / ``mlp_bias``. Both sides rotate query/key halves
the same way (rotate-half RoPE), so q and k need no permutation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models.config import ModelConfig, RopeScaling
from jaxpar.models.transformer import Transformer
from jaxpar.placement.sharding import shard_model

# Transforms: (to ours: (hf array, our shape) -> array, to HF: our array -> array).
_SAME = (lambda w, s: w.reshape(s), lambda w: w)
_FLAT = (lambda w, s: w.reshape(s), lambda w: w.reshape(-1))
_IN = (lambda w, s: w.T.reshape(s), lambda w: w.reshape(w.shape[0], -1).T)  # ours [D, ...]
_OUT = (lambda w, s: w.T.reshape(s), lambda w: w.reshape(-1, w.shape[-1]).T)  # ours [..., D]

_L = "model.layers.{i}."
# Our path -> (HF name, transforms). Rows whose path the model lacks (biases, lm_head
# when tied) are skipped; a model variable without a row is an error.
TABLE: dict[tuple[str, ...], tuple[str, tuple]] = {
    ("embed",): ("model.embed_tokens.weight", _SAME),
    ("final_norm", "scale"): ("model.norm.weight", _SAME),
    ("lm_head",): ("lm_head.weight", _IN),
    ("layers", "attn_norm", "scale"): (_L + "input_layernorm.weight", _SAME),
    ("layers", "mlp_norm", "scale"): (_L + "post_attention_layernorm.weight", _SAME),
    **{("layers", "attn", p): (_L + f"self_attn.{p}_proj.weight", _IN) for p in "qkv"},
    ("layers", "attn", "o"): (_L + "self_attn.o_proj.weight", _OUT),
    **{("layers", "attn", f"{p}_bias"): (_L + f"self_attn.{p}_proj.bias", _FLAT) for p in "qkvo"},
    **{("layers", "mlp", p): (_L + f"mlp.{p}_proj.weight", _IN) for p in ("gate", "up")},
    ("layers", "mlp", "down"): (_L + "mlp.down_proj.weight", _OUT),
    **{("layers", "mlp", f"{p}_bias"): (_L + f"mlp.{p}_proj.bias", _FLAT)
       for p in ("gate", "up", "down")},
}
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


def _names(path, layers):
    """HF tensor names of one of our variables: L of them for stacked layers."""
    name = TABLE[path][0]
    return [name.format(i=i) for i in range(layers)] if path[0] == "layers" else [name]


def _check_mapped(paths):
    if unmapped := [".".join(p) for p in paths if p not in TABLE]:
        raise ValueError(f"no Hugging Face mapping for model variables {unmapped}")


def _read_config(path: pathlib.Path) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    return config_from_dict(hf, path / "config.json")


def config_from_dict(hf: dict, where) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face Llama ``config.json`` dict ``hf``; error
    lines name ``where`` (the file, or what the dict was made from: models/gguf.py
    builds one from GGUF metadata)."""
    archs = hf.get("architectures") or []
    if not ("LlamaForCausalLM" in archs if archs else hf.get("model_type") == "llama"):
        raise ValueError(
            f"{where}: unsupported architecture "
            f"{archs or hf.get('model_type')!r}; only LlamaForCausalLM is read"
        )
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "vocab_size")
    if missing := [k for k in required if not isinstance(hf.get(k), int)]:
        raise ValueError(f"{where} lacks integer {', '.join(missing)}")
    if (act := hf.get("hidden_act", "silu")) != "silu":
        raise ValueError(f"{where}: hidden_act={act!r}; only 'silu' is supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3") or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{where}: RoPE {rope}; only 'default' and 'llama3' are supported"
        )
    heads = hf["num_attention_heads"]
    try:
        scaling = None if kind == "default" else RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope.get("original_max_position_embeddings")
                                      or hf["max_position_embeddings"]),
        )
        return ModelConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], layers=hf["num_hidden_layers"],
            heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            mlp_dim=hf["intermediate_size"], norm="rms", mlp="swiglu", position="rope",
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=scaling, max_position=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        raise ValueError(f"{where}: RoPE {rope} lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                raise FileNotFoundError(f"{index} lists shard {file}, which is not in {path}")
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = ", ".join(p.name for p in sorted(path.glob("*.bin")))
        why = f"; pickle .bin checkpoints ({pickles}) are not loaded" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {path}{why}")
    from safetensors import safe_open

    names = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def from_hf(path, *, dtype="float32", mesh=None, rules=None) -> Transformer:
    """Builds a ``Transformer`` from a local Hugging Face Llama directory.

    Args:
      path: directory with ``config.json`` and ``*.safetensors`` weights.
      dtype: compute and parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
      mesh, rules: if ``mesh`` is given, the model is placed on it by
        ``jaxpar.shard_model(model, mesh, rules)``.

    Raises:
      FileNotFoundError: no such directory, config.json, weights or index shard.
      ValueError: an unsupported config, or tensors missing, unexpected or misshapen.
    """
    from safetensors import safe_open

    path = pathlib.Path(path)
    if not path.is_dir():
        why = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"Hugging Face checkpoint directory {path} {why}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    cfg = _read_config(path)
    files = _tensor_files(path)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="numpy"))
                   for f in set(files.values())}
        return load_tensors(cfg, files, lambda name: handles[files[name]].get_tensor(name),
                            dtype=dtype, mesh=mesh, rules=rules,
                            mismatch=f"checkpoint {path} does not match its config.json")


def load_tensors(cfg: ModelConfig, names: Collection[str], read: Callable[[str], np.ndarray], *,
                 dtype, mesh, rules, mismatch: str) -> Transformer:
    """The ``Transformer`` of ``cfg`` in ``dtype`` holding a checkpoint's weights.

    Args:
      names: every tensor the checkpoint holds, by Hugging Face name (``TABLE``).
      read: the tensor of a name as an array in Hugging Face layout (``[out, in]``).
      mesh, rules: as in ``from_hf``.
      mismatch: the start of the error line when tensors are missing, misshapen or
        unexpected (which checkpoint, against what).
    """
    dtype = jnp.dtype(dtype).name
    cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    _check_mapped(variables)
    missing, misshapen, used = [], [], set()
    for p, var in variables.items():
        shape, (_, (to_ours, back)) = var.get_value().shape, TABLE[p]
        per_layer = shape[1:] if p[0] == "layers" else shape
        expected = jax.eval_shape(back, jax.ShapeDtypeStruct(per_layer, np.float32)).shape
        arrays = []
        for name in _names(p, cfg.layers):
            w = read(name) if name in names else None
            used.add(name)
            if w is None:
                missing.append(name)
            elif w.shape != expected:
                misshapen.append(f"{name} expected {expected}, found {w.shape}")
            else:
                arrays.append(np.asarray(to_ours(w, per_layer), dtype=dtype))
        if len(arrays) == len(_names(p, cfg.layers)):
            value = np.stack(arrays) if p[0] == "layers" else arrays[0]
            # With a mesh, host arrays go to their shards only (shard_model below).
            var.set_value(jnp.asarray(value) if mesh is None else value)
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unused = sorted(n for n in set(names) - used - ignored if not n.endswith(_IGNORED))
    problems = [f"missing tensors: {', '.join(missing)}"] if missing else []
    problems += [f"wrong shapes: {'; '.join(misshapen)}"] if misshapen else []
    problems += [f"unexpected tensors: {', '.join(unused)}"] if unused else []
    if problems:
        raise ValueError(f"{mismatch}: " + " | ".join(problems))
    model = nnx.merge(graphdef, state)
    return model if mesh is None else shard_model(model, mesh, rules)


def _hf_config(cfg: ModelConfig, dtype: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if (s := cfg.rope_scaling) is not None:
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_position,
        "rope_parameters": rope,  # transformers >= 5; older versions read the next two
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if s else None,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias, "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,
    }


def to_hf(model: Transformer, path, *, dtype=None, overwrite=False) -> None:
    """Writes ``model`` as a Hugging Face Llama checkpoint (config.json, model.safetensors).

    Args:
      model: a Llama-style ``Transformer`` (norm="rms", mlp="swiglu", position="rope").
      path: directory to write; created if missing.
      dtype: dtype of the saved weights (default: the model's parameter dtype).
      overwrite: replace an existing checkpoint in ``path`` (its config.json, index and
        *.safetensors); without it, a directory holding one is refused.

    Raises:
      ValueError: the model is not Llama-style.
      FileExistsError: ``path`` already holds a checkpoint and ``overwrite`` is False.
    """
    from safetensors.numpy import save_file

    cfg: ModelConfig = model.cfg
    style = {"norm": "rms", "mlp": "swiglu", "position": "rope"}
    if wrong := {k: getattr(cfg, k) for k, v in style.items() if getattr(cfg, k) != v}:
        raise ValueError(f"to_hf writes Llama models only ({style}); this model has {wrong}")
    if cfg.moe is not None:
        raise ValueError("to_hf writes dense Llama models only; this model has model.moe (Mixtral and Qwen3-MoE "
                         "export is not built yet)")
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    existing = [p for p in path.glob("*") if p.name == "config.json"
                or p.name.endswith((".safetensors", ".safetensors.index.json"))]
    if existing and not overwrite:
        raise FileExistsError(
            f"{path} already holds {', '.join(sorted(p.name for p in existing))}; "
            "pass overwrite=True to replace them"
        )
    dtype = jnp.dtype(dtype or cfg.param_dtype)
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    _check_mapped(variables)
    tensors = {}
    for p, var in variables.items():
        _, (_, to_hf_fn) = TABLE[p]
        value = np.asarray(jax.device_get(var.get_value()))
        layers = value if p[0] == "layers" else value[None]
        for name, w in zip(_names(p, cfg.layers), layers):
            tensors[name] = np.ascontiguousarray(to_hf_fn(w).astype(dtype))
    path.mkdir(parents=True, exist_ok=True)
    for p in existing:
        p.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_hf_config(cfg, dtype.name), indent=2) + "\n")
