"""Hugging Face checkpoints <-> jaxpar ``Transformer``: Llama, Qwen3, Mixtral, Qwen3-MoE.

Reads and writes a local directory holding ``config.json`` and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``). Pickle ``*.bin`` files are never
loaded. Which architecture a model is, and its config keys, are ``models.hf_config``'s;
the tensors are mapped here by one table per architecture (``TABLES``).

Layout. HF ``nn.Linear`` weights are ``[out, in]``, ours ``[in, ..., out]``. HF's per-layer
tensors ``model.layers.{i}.<name>`` are stacked on our leading ``L`` axis; per-expert ones
``...experts.{j}...`` on our ``E`` axis after it.

  ours                    shape         HF <name>                        shape    ours <- W
  embed                   [V, D]        model.embed_tokens.weight        [V, D]   W
  layers.attn.q           [L, D, N, H]  self_attn.q_proj.weight          [N*H, D] W.T -> D,N,H
  layers.attn.k, v        [L, D, K, H]  self_attn.k_proj, v_proj.weight  [K*H, D] W.T -> D,K,H
  layers.attn.o           [L, N, H, D]  self_attn.o_proj.weight          [D, N*H] W.T -> N,H,D
  layers.attn.q/k_norm    [L, H]        self_attn.q_norm, k_norm.weight  [H]      W (Qwen3)
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
  MoE layers (Mixtral: block_sparse_moe.gate, .experts.{j}.w1, w3, w2; Qwen3-MoE below):
  layers.moe.router       [L, D, E]     mlp.gate.weight                  [E, D]   W.T
  layers.moe.gate, up     [L, E, D, F]  mlp.experts.{j}.gate/up_proj.w.  [F, D]   W.T
  layers.moe.down         [L, E, F, D]  mlp.experts.{j}.down_proj.weight [D, F]   W.T

With ``model.moe.every = n > 1`` (Qwen3-MoE's ``decoder_sparse_step``) our stack is of
groups of ``n`` layers: ``layers.dense[i]`` of group ``g`` is HF layer ``g n + i``,
``layers.sparse`` HF layer ``g n + n - 1``. These are the names on disk and on the Hub
(transformers 5 fuses the experts into ``gate_up_proj`` in memory only, converting on
load and save: ``conversion_mapping.py``), which transformers and vLLM read.

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

from jaxpar.models import hf_config
from jaxpar.models.config import ModelConfig
from jaxpar.models.hf_config import config_from_dict
from jaxpar.models.transformer import Transformer
from jaxpar.placement.sharding import shard_model

# Transforms: (to ours: (hf array, our shape) -> array, to HF: our array -> array).
_SAME = (lambda w, s: w.reshape(s), lambda w: w)
_FLAT = (lambda w, s: w.reshape(s), lambda w: w.reshape(-1))
_IN = (lambda w, s: w.T.reshape(s), lambda w: w.reshape(w.shape[0], -1).T)  # ours [D, ...]
_OUT = (lambda w, s: w.T.reshape(s), lambda w: w.reshape(-1, w.shape[-1]).T)  # ours [..., D]

_L = "model.layers.{i}."
# Our path (within a layer for stacked layers) -> (HF name, after _L for a layer's,
# transforms). Rows whose path the model lacks (biases, lm_head when tied) are skipped;
# a model variable without a row is an error.
_TOP = {
    ("embed",): ("model.embed_tokens.weight", _SAME),
    ("final_norm", "scale"): ("model.norm.weight", _SAME),
    ("lm_head",): ("lm_head.weight", _IN),
}
_ATTENTION = {
    ("attn_norm", "scale"): ("input_layernorm.weight", _SAME),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", _SAME),
    **{("attn", p): (f"self_attn.{p}_proj.weight", _IN) for p in "qkv"},
    ("attn", "o"): ("self_attn.o_proj.weight", _OUT),
    **{("attn", f"{p}_bias"): (f"self_attn.{p}_proj.bias", _FLAT) for p in "qkvo"},
}
_QK_NORM = {("attn", f"{p}_norm"): (f"self_attn.{p}_norm.weight", _SAME) for p in "qk"}
_MLP = {
    **{("mlp", p): (f"mlp.{p}_proj.weight", _IN) for p in ("gate", "up")},
    ("mlp", "down"): ("mlp.down_proj.weight", _OUT),
    **{("mlp", f"{p}_bias"): (f"mlp.{p}_proj.bias", _FLAT) for p in ("gate", "up", "down")},
}


def _experts(prefix: str, router: str, gate: str, up: str, down: str) -> dict:
    """A MoE layer's rows: ``{j}`` in a name is the expert."""
    return {("moe", "router"): (f"{prefix}.{router}.weight", _IN),
            ("moe", "gate"): (f"{prefix}.experts.{{j}}.{gate}.weight", _IN),
            ("moe", "up"): (f"{prefix}.experts.{{j}}.{up}.weight", _IN),
            ("moe", "down"): (f"{prefix}.experts.{{j}}.{down}.weight", _OUT)}


TABLES: dict[str, dict[tuple, tuple[str, tuple]]] = {
    hf_config.LLAMA: {**_TOP, **_ATTENTION, **_MLP},
    hf_config.QWEN3: {**_TOP, **_ATTENTION, **_QK_NORM, **_MLP},
    hf_config.MIXTRAL: {**_TOP, **_ATTENTION, **_experts("block_sparse_moe", "gate", "w1", "w3", "w2")},
    hf_config.QWEN3_MOE: {**_TOP, **_ATTENTION, **_QK_NORM, **_MLP,
                          **_experts("mlp", "gate", "gate_proj", "up_proj", "down_proj")},
}
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


def _row(path, cfg: ModelConfig):
    """``(table key, HF layer indices)`` of one of our variables (indices None for one
    outside the stacked layers); see the module docstring for ``every > 1``."""
    if path[0] != "layers":
        return path, None
    n, groups = 1 if cfg.moe is None else cfg.moe.every, range(cfg.stacked_layers)
    if path[1] == "dense":
        return path[3:], [g * n + path[2] for g in groups]
    if path[1] == "sparse":
        return path[2:], [g * n + n - 1 for g in groups]
    return path[1:], list(groups)


def _names(path, cfg: ModelConfig, table) -> np.ndarray:
    """HF tensor names of one of our variables, an object array of the shape of its
    leading axes: ``[]``, ``[L]`` for stacked layers, ``[L, E]`` for experts."""
    key, layers = _row(path, cfg)
    name = table[key][0]
    if layers is None:
        return np.array(name, dtype=object)
    if "{j}" in name:
        return np.array([[(_L + name).format(i=i, j=j) for j in range(cfg.moe.experts)] for i in layers], object)
    return np.array([(_L + name).format(i=i) for i in layers], dtype=object)


def _check_mapped(paths, cfg: ModelConfig) -> dict:
    """The table of ``cfg``'s architecture; ``ValueError`` naming variables it lacks."""
    arch = hf_config.architecture(cfg)
    table = TABLES[arch]
    if unmapped := [".".join(map(str, p)) for p in paths if _row(p, cfg)[0] not in table]:
        raise ValueError(f"no Hugging Face {arch} mapping for model variables {unmapped}")
    return table


def _read_config(path: pathlib.Path) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    return config_from_dict(hf, path / "config.json")


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
    """Builds a ``Transformer`` from a local Hugging Face directory (Llama, Qwen3,
    Mixtral or Qwen3-MoE: ``models.hf_config``).

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
      names: every tensor the checkpoint holds, by Hugging Face name (``TABLES``).
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
    table = _check_mapped(variables, cfg)
    missing, misshapen, used = [], [], set()
    for p, var in variables.items():
        hf_names, (to_ours, back) = _names(p, cfg, table), table[_row(p, cfg)[0]][1]
        shape = var.get_value().shape
        one = shape[hf_names.ndim:]  # one HF tensor's share of the variable
        expected = jax.eval_shape(back, jax.ShapeDtypeStruct(one, np.float32)).shape
        arrays = []
        for name in hf_names.flat:
            w = read(name) if name in names else None
            used.add(name)
            if w is None:
                missing.append(name)
            elif w.shape != expected:
                misshapen.append(f"{name} expected {expected}, found {w.shape}")
            else:
                arrays.append(np.asarray(to_ours(w, one), dtype=dtype))
        if len(arrays) == hf_names.size:
            value = np.stack(arrays).reshape(shape)
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


def to_hf(model: Transformer, path, *, dtype=None, overwrite=False) -> None:
    """Writes ``model`` as a Hugging Face checkpoint (config.json, model.safetensors) of
    its architecture (``models.hf_config.architecture``: Llama, Qwen3, Mixtral or
    Qwen3-MoE), in the Hub's tensor names (the module docstring). A MoE model trained with
    a ``capacity_factor`` is written as it is; transformers runs it dropless.

    Args:
      model: a Llama-style ``Transformer`` (norm="rms", mlp="swiglu", position="rope").
      path: directory to write; created if missing.
      dtype: dtype of the saved weights (default: the model's parameter dtype).
      overwrite: replace an existing checkpoint in ``path`` (its config.json, index and
        *.safetensors); without it, a directory holding one is refused.

    Raises:
      ValueError: the model is none of those architectures (``hf_config.check_writable``).
      FileExistsError: ``path`` already holds a checkpoint and ``overwrite`` is False.
    """
    from safetensors.numpy import save_file

    cfg: ModelConfig = model.cfg
    hf_config.check_writable(cfg)
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
    table = _check_mapped(variables, cfg)
    tensors = {}
    for p, var in variables.items():
        hf_names, (_, to_hf_fn) = _names(p, cfg, table), table[_row(p, cfg)[0]][1]
        value = np.asarray(jax.device_get(var.get_value()))
        for name, w in zip(hf_names.flat, value.reshape(-1, *value.shape[hf_names.ndim:])):
            tensors[name] = np.ascontiguousarray(to_hf_fn(w).astype(dtype))
    path.mkdir(parents=True, exist_ok=True)
    for p in existing:
        p.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config.hf_config(cfg, dtype.name), indent=2) + "\n")
