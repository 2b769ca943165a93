"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the architectures ``models.hf``
reads and writes; which one a model is follows from its config alone (``architecture``):

  architecture         jaxpar model (norm="rms", mlp="swiglu", position="rope")
  LlamaForCausalLM     dense
  Qwen3ForCausalLM     dense, qk_norm
  MixtralForCausalLM   model.moe: softmax router, normalize, every=1, no shared experts
  Qwen3MoeForCausalLM  model.moe and qk_norm: normalize = norm_topk_prob, every =
                       decoder_sparse_step (the other layers dense, mlp_dim wide)

Keys read: ``num_local_experts`` (Mixtral) or ``num_experts`` (Qwen3-MoE; either is
taken), ``num_experts_per_tok``, the expert width (Mixtral's ``intermediate_size``,
Qwen3-MoE's ``moe_intermediate_size``), ``norm_topk_prob``, ``decoder_sparse_step``.
``router_aux_loss_coef`` c becomes ``model.moe.balance_loss = c * k / M`` (k experts per
token, M MoE layers): transformers adds ``c`` times ``k * E * sum_e f_e P_e`` over the
tokens of all M layers pooled (``load_balancing_loss_func``, when trained with
``output_router_logits``), jaxpar ``balance_loss`` times ``E * sum_e f_e P_e`` per layer
summed, so the two are equal when the layers' routings agree; export inverts it.

Refused with one line: sliding-window attention (``use_sliding_window``, Mixtral's
``sliding_window``), ``mlp_only_layers`` other than ``[]``, ``router_jitter_noise``, an
activation other than SiLU, RoPE other than default and llama3.
"""

from __future__ import annotations

from jaxpar.models.config import ModelConfig, MoEConfig, RopeScaling

LLAMA, QWEN3, MIXTRAL, QWEN3_MOE = ("LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
                                    "Qwen3MoeForCausalLM")
MODEL_TYPES = {LLAMA: "llama", QWEN3: "qwen3", MIXTRAL: "mixtral", QWEN3_MOE: "qwen3_moe"}


def architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture a model is read as and written as."""
    if cfg.moe is None:
        return QWEN3 if cfg.qk_norm else LLAMA
    return QWEN3_MOE if cfg.qk_norm else MIXTRAL


def _architecture_of(hf: dict, where) -> str:
    archs = hf.get("architectures") or []
    by_type = {t: a for a, t in MODEL_TYPES.items()}
    arch = next((a for a in archs if a in MODEL_TYPES), None) if archs else by_type.get(hf.get("model_type"))
    if arch is None:
        raise ValueError(f"{where}: unsupported architecture {archs or hf.get('model_type')!r}; only "
                         f"{', '.join(MODEL_TYPES)} are read")
    return arch


def _refuse_unsupported(hf: dict, arch: str, where) -> None:
    """One ``ValueError`` line for the first setting jaxpar does not implement."""
    if (act := hf.get("hidden_act", "silu")) != "silu":
        raise ValueError(f"{where}: hidden_act={act!r}; only 'silu' is supported")
    if arch in (QWEN3, QWEN3_MOE) and hf.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true; jaxpar's attention has no sliding window")
    if arch == MIXTRAL and hf.get("sliding_window") is not None:
        raise ValueError(f"{where}: sliding_window={hf['sliding_window']!r}; jaxpar's attention has no "
                         "sliding window (only null is read)")
    if arch == QWEN3_MOE and (dense := hf.get("mlp_only_layers")):
        raise ValueError(f"{where}: mlp_only_layers={dense!r}; only [] is read (dense layers by "
                         "decoder_sparse_step alone)")
    if arch == MIXTRAL and (jitter := hf.get("router_jitter_noise", 0.0)):
        raise ValueError(f"{where}: router_jitter_noise={jitter!r}; jaxpar's router has no jitter (only 0)")


def _moe_of(hf: dict, arch: str, where) -> MoEConfig | None:
    if arch not in (MIXTRAL, QWEN3_MOE):
        return None
    width = "intermediate_size" if arch == MIXTRAL else "moe_intermediate_size"
    # The Hub's key, else the other: transformers' attribute_map makes them one, 5.x writes either.
    names = ("num_local_experts", "num_experts") if arch == MIXTRAL else ("num_experts", "num_local_experts")
    experts = next((n for n in names if n in hf), names[0])
    if missing := [k for k in (experts, "num_experts_per_tok", width) if not isinstance(hf.get(k), int)]:
        raise ValueError(f"{where} lacks integer {', '.join(missing)}")
    every = hf.get("decoder_sparse_step", 1) if arch == QWEN3_MOE else 1
    k = hf["num_experts_per_tok"]
    moe_layers = hf["num_hidden_layers"] // every if isinstance(every, int) and every > 0 else 1
    try:
        return MoEConfig(
            experts=hf[experts], experts_per_token=k, expert_width=hf[width], every=every,
            normalize=bool(hf.get("norm_topk_prob", False)) if arch == QWEN3_MOE else True,
            balance_loss=float(hf.get("router_aux_loss_coef", 0.001)) * k / max(moe_layers, 1),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def config_from_dict(hf: dict, where) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` dict ``hf`` (an architecture
    of the module docstring); error lines name ``where`` (the file, or what the dict was
    made from: models/gguf.py builds one from GGUF metadata)."""
    arch = _architecture_of(hf, where)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if missing := [k for k in required if not isinstance(hf.get(k), int)]:
        raise ValueError(f"{where} lacks integer {', '.join(missing)}")
    _refuse_unsupported(hf, arch, where)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3") or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: RoPE {rope}; only 'default' and 'llama3' are supported")
    heads, moe = hf["num_attention_heads"], _moe_of(hf, arch, where)
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
            qk_norm=arch in (QWEN3, QWEN3_MOE), moe=moe,
        )
    except KeyError as e:
        raise ValueError(f"{where}: RoPE {rope} lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def check_writable(cfg: ModelConfig) -> None:
    """``ValueError`` (one line) unless ``cfg`` is one of the architectures written."""
    style = {"norm": "rms", "mlp": "swiglu", "position": "rope"}
    if wrong := {k: getattr(cfg, k) for k, v in style.items() if getattr(cfg, k) != v}:
        raise ValueError(f"to_hf writes Llama models only ({style}); this model has {wrong}")
    arch, moe = architecture(cfg), cfg.moe
    problems = []
    if cfg.mlp_bias and arch != LLAMA:
        problems.append("model.mlp_bias (only LlamaForCausalLM has MLP biases)")
    if cfg.attention_bias and arch == MIXTRAL:
        problems.append("model.attention_bias (Mixtral has none)")
    if moe is not None:
        if moe.router != "softmax":
            problems.append(f"model.moe.router={moe.router!r} (only 'softmax')")
        if moe.shared_experts:
            problems.append(f"model.moe.shared_experts={moe.shared_experts} (only 0)")
        if arch == MIXTRAL and (moe.every != 1 or not moe.normalize):
            problems.append(f"model.moe.every={moe.every}, normalize={moe.normalize} (Mixtral: 1, true; "
                            "with model.qk_norm it is written as Qwen3MoeForCausalLM)")
    if problems:
        raise ValueError(f"to_hf cannot write this model as {arch}: {'; '.join(problems)}")


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """The ``config.json`` of ``cfg`` (``check_writable``) with weights in ``dtype``, in
    the keys the Hub's checkpoints of its architecture use."""
    arch, moe = architecture(cfg), cfg.moe
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if (s := cfg.rope_scaling) is not None:
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position)
    out = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_position,
        "rope_parameters": rope,  # transformers >= 5; older versions read the next two
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if s else None,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "initializer_range": cfg.init_std, "use_cache": True, "dtype": dtype, "torch_dtype": dtype,
    }
    if arch != MIXTRAL:
        out["attention_bias"] = cfg.attention_bias
    if arch == LLAMA:
        out["mlp_bias"] = cfg.mlp_bias
    if arch in (QWEN3, QWEN3_MOE):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.layers)
    if moe is None:
        return out
    coef = moe.balance_loss * (cfg.layers // moe.every) / moe.experts_per_token  # the docstring's c
    out.update(num_experts_per_tok=moe.experts_per_token, router_aux_loss_coef=coef, output_router_logits=False)
    if arch == MIXTRAL:
        out.update(intermediate_size=moe.expert_width, num_local_experts=moe.experts, sliding_window=None,
                   router_jitter_noise=0.0)
    else:
        out.update(num_experts=moe.experts, moe_intermediate_size=moe.expert_width,
                   decoder_sparse_step=moe.every, norm_topk_prob=moe.normalize, mlp_only_layers=[])
    return out
