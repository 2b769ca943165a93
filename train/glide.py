"""GliDe draft training (``jaxpar-train glide target_run_dir=DIR``): what the training
loop (``jaxpar.train.loop``) plugs in for ``task: glide``.

The trained model is a ``jaxpar.models.GlideDraft`` for the target's ``ModelConfig``;
the target is frozen and is never differentiated or updated:

* ``teacher`` runs the target teacher-forced over each batch, in a jit of its own that
  takes the target's parameters as an argument, and adds to the batch the keys/values
  of the layers the draft reads (and the target's log-probabilities, for the KL term);
* the train step takes the target's state as its ``frozen`` argument
  (``jaxpar.train.step.make_train_step``), from which ``loss_fn`` borrows the token
  embedding and the LM head that the draft shares.

Neither closes over the target's arrays, which would make them constants of the
compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.glide import GlideDraft, cross_block_mask
from jaxpar.models.transformer import init_cache
from jaxpar.train.config import Config
from jaxpar.train.step import Batch, cross_entropy, masked_mean


def prepare(cfg: Config) -> tuple[Config, Transformer]:
    """Loads the target in ``cfg.target_run_dir`` (a jaxpar run, a Hugging Face
    directory or a GGUF file, on one device) and returns ``(cfg, target)`` with
    ``cfg.model`` the target's model config and ``cfg.data.tokenizer`` its
    ``tokenizer.json`` (a GGUF file: the file itself): the draft run's ``config.yaml``
    then says what it was trained for.

    Raises:
      ValueError: settings a GliDe run does not take, or a target too shallow.
      FileNotFoundError: no target model or tokenizer there.
    """
    from jaxpar.models.gguf import is_gguf
    from jaxpar.train.runs import load_model

    if cfg.dry_run:
        raise ValueError("dry_run=true is not supported with task=glide")
    if cfg.mesh.pipe > 1 or cfg.mesh.seq > 1:
        raise ValueError(f"task=glide runs without pipeline or sequence parallelism, got "
                         f"mesh.pipe={cfg.mesh.pipe} mesh.seq={cfg.mesh.seq}")
    target_dir = pathlib.Path(cfg.target_run_dir)
    tokenizer = target_dir if is_gguf(target_dir) else target_dir / "tokenizer.json"
    if cfg.data.tokenizer is not None and pathlib.Path(cfg.data.tokenizer).resolve() != tokenizer.resolve():
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r}: a GliDe draft uses its target's "
                         f"tokenizer ({tokenizer}); leave data.tokenizer unset")
    target = load_model(target_dir)
    if cfg.model not in (ModelConfig(), target.cfg):
        raise ValueError("model.* of a glide run is its target's (target_run_dir); leave the "
                         "model settings unset")
    if cfg.glide.layers > target.cfg.layers:
        raise ValueError(f"glide.layers={cfg.glide.layers} exceeds the target's model.layers="
                         f"{target.cfg.layers} ({target_dir})")
    if not tokenizer.is_file():
        raise FileNotFoundError(f"no tokenizer.json in target_run_dir={target_dir}")
    data = dataclasses.replace(cfg.data, tokenizer=str(tokenizer))
    return dataclasses.replace(cfg, model=target.cfg, data=data), target


def teacher(target: Transformer, cfg: Config, sharding=None):
    """The jitted ``(target_state, batch) -> batch`` that adds the target's
    teacher-forced keys and values of the layers the draft reads, ``target_k`` and
    ``target_v`` ``[B, T, L_d, K, H]`` (batch first, so the step's batch sharding splits
    them as it splits the tokens), and with ``glide.kl_weight`` > 0 its float32
    log-probabilities ``target_logprobs [B, T, V]``. ``sharding``: the step's batch
    sharding, for the outputs (None without a mesh)."""
    graphdef = nnx.graphdef(target)
    start = target.cfg.layers - cfg.glide.layers
    with_logprobs = cfg.glide.kl_weight > 0

    def forward(state, batch: Batch) -> Batch:
        model = nnx.merge(graphdef, state)
        B, T = batch["inputs"].shape
        logits, cache = model(batch["inputs"], positions=batch["positions"],
                              segment_ids=batch["segment_ids"], cache=init_cache(model.cfg, B, T))
        layers = lambda x: jnp.moveaxis(x[start:], 0, 2)  # [L, B, T, K, H] -> [B, T, L_d, K, H]
        out = dict(batch, target_k=layers(cache.k), target_v=layers(cache.v))
        if with_logprobs:
            out["target_logprobs"] = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return out

    return jax.jit(forward) if sharding is None else jax.jit(forward, out_shardings=sharding)


def make_loss(cfg: Config, target: Transformer):
    """``loss_fn`` for ``cfg.glide`` and ``target``'s structure, as the train step calls
    it: ``(draft, batch, target_state) -> scalar``."""
    return functools.partial(loss_fn, target_graphdef=nnx.graphdef(target),
                             block_size=cfg.glide.block_size, kl_weight=cfg.glide.kl_weight)


def loss_fn(draft: GlideDraft, batch: Batch, target_state, *, target_graphdef, block_size: int,
            kl_weight: float = 0.0) -> jax.Array:
    """The draft's mean next-token loss over the batch's ``mask``, plus ``kl_weight`` x
    the mean KL(target || draft) per token when ``kl_weight`` > 0.

    ``batch``: the loader's keys plus ``teacher``'s; the draft's queries see the
    target's keys/values through ``cross_block_mask`` (``block_size`` = gamma + 1).
    ``target_state``: the target's ``nnx.State``, for its embedding and LM head.
    """
    target = nnx.merge(target_graphdef, target_state)
    positions, segment_ids, mask = batch["positions"], batch.get("segment_ids"), batch.get("mask")
    k = jnp.moveaxis(batch["target_k"], 2, 0)  # [B, T, L_d, K, H] -> [L_d, B, T, K, H]
    v = jnp.moveaxis(batch["target_v"], 2, 0)
    logits = draft(batch["inputs"], target, k, v, cross_block_mask(positions, segment_ids, block_size),
                   positions=positions, segment_ids=segment_ids)
    loss = cross_entropy(logits, batch["targets"], mask)
    if kl_weight > 0:
        target_logp = batch["target_logprobs"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        kl = (jnp.exp(target_logp) * (target_logp - logp)).sum(-1)  # [B, T]
        loss = loss + kl_weight * masked_mean(kl, mask)
    return loss
