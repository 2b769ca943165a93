"""GliDe draft training (``jaxpar-train glide target_run_dir=DIR``): what the training
loop (``jaxpar.train.loop``) plugs in for ``task: glide``.

The trained model is a ``jaxpar.models.GlideDraft`` for the target's ``ModelConfig``;
the target is frozen and is never differentiated or updated:

* ``teacher`` runs the target teacher-forced over each batch, in a jit of its own that
  takes the target's parameters as an argument, and adds to the batch the keys/values
  of the layers the draft reads (and the target's log-probabilities, for the KL term);
  with ``glide.teacher_cache=DIR`` those come from a cache the teacher fills once
  (``jaxpar.train.teacher_cache``) and the step never runs the target (``Teacher``);
* the train step takes the target's state as its ``frozen`` argument
  (``jaxpar.train.step.make_train_step``), from which ``loss_fn`` borrows the token
  embedding and the LM head that the draft shares.

Neither closes over the target's arrays, which would make them constants of the
compiled programs.

Distillation (``glide.kl_weight`` > 0) adds ``kl_weight`` x KL(target || draft) per
token. ``glide.distill=full`` compares whole distributions; ``topk`` (the default for a
target of ``LARGE_VOCAB`` tokens or more, where distillation is also on by default, and
with a teacher cache) the target's top ``glide.teacher_topk`` tokens, both distributions
renormalised over them: the "Top-K" sparse distillation of cached teacher logits, which
Anshumann et al., "Sparse Logit Sampling: Accelerating Knowledge Distillation in LLMs"
(ACL 2025, arXiv:2503.16870) take as the usual practice (and show to be biased toward
the head of the distribution, which is where a draft's acceptance is decided).

``glide.draft_vocab=N``: the draft predicts over the ``N`` most frequent tokens of the
training split (``draft_vocabulary``, counted once and kept in the run dir as
``draft_vocab.npy``), its head those columns of the target's. Its next-token loss counts
the positions whose target token is among them; its KL reads the teacher's tokens among
them, renormalised.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.glide import DraftVocab, GlideDraft, cross_block_mask, feature_sources
from jaxpar.models.cache import init_cache
from jaxpar.train import teacher_cache
from jaxpar.train.config import Config
from jaxpar.train.data import PackedRows
from jaxpar.train.losses import Batch, cross_entropy, masked_mean

log = logging.getLogger(__name__)

# A "large" vocabulary: 32,000 tokens or more (Llama 2 and Vicuna, the GliDe paper's
# targets, and every larger one: Mistral's 32,768, SmolLM2's 49,152, Llama 3's 128,256).
# There the whole distribution is 125 KiB or more per token in float32, over 250 times a
# top-64's 512 bytes, and distillation from the target's top-k is the default
# (``glide.kl_weight`` DEFAULT_KL_WEIGHT, ``glide.distill`` topk).
LARGE_VOCAB = 32_000
DEFAULT_KL_WEIGHT = 1.0
VOCAB_FILE = "draft_vocab.npy"


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
    if cfg.layout.pipe > 1 or cfg.layout.seq > 1:
        raise ValueError(f"task=glide runs without pipeline or sequence parallelism, got "
                         f"mesh.pipe={cfg.layout.pipe} mesh.seq={cfg.layout.seq}")
    target_dir = pathlib.Path(cfg.target_run_dir)
    tokenizer = target_dir if is_gguf(target_dir) else target_dir / "tokenizer.json"
    if cfg.data.tokenizer is not None and pathlib.Path(cfg.data.tokenizer).resolve() != tokenizer.resolve():
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r}: a GliDe draft uses its target's "
                         f"tokenizer ({tokenizer}); leave data.tokenizer unset")
    target = load_model(target_dir)
    if target.cfg.moe is not None:
        raise ValueError(f"task=glide with a mixture-of-experts target ({target_dir}) is not supported yet")
    if cfg.model not in (ModelConfig(), target.cfg):
        raise ValueError("model.* of a glide run is its target's (target_run_dir); leave the "
                         "model settings unset")
    if cfg.glide.layers > target.cfg.layers:
        raise ValueError(f"glide.layers={cfg.glide.layers} exceeds the target's model.layers="
                         f"{target.cfg.layers} ({target_dir})")
    if not tokenizer.is_file():
        raise FileNotFoundError(f"no tokenizer.json in target_run_dir={target_dir}")
    V = target.cfg.vocab_size
    if cfg.glide.draft_vocab is not None and cfg.glide.draft_vocab >= V:
        raise ValueError(f"glide.draft_vocab={cfg.glide.draft_vocab} must be below the target's "
                         f"vocabulary of {V} tokens (leave it unset for all)")
    if cfg.glide.self_distill and cfg.glide.prompt_tokens >= cfg.seq_len:
        raise ValueError(f"glide.prompt_tokens={cfg.glide.prompt_tokens} must be below seq_len={cfg.seq_len}: "
                         "a self-distilled row is a prompt and the target's continuation of it")
    data = dataclasses.replace(cfg.data, tokenizer=str(tokenizer))
    return dataclasses.replace(cfg, model=target.cfg, data=data, glide=resolve(cfg.glide, V)), target


def resolve(glide_cfg, vocab_size: int):
    """``glide_cfg`` with ``kl_weight`` None and ``distill`` auto decided for a target
    of ``vocab_size`` tokens (see ``LARGE_VOCAB``)."""
    large = vocab_size >= LARGE_VOCAB
    kl_weight = glide_cfg.kl_weight
    if kl_weight is None:
        kl_weight = DEFAULT_KL_WEIGHT if large else 0.0
    distill = glide_cfg.distill
    if distill == "auto":
        distill = "topk" if large or glide_cfg.teacher_cache is not None else "full"
    return dataclasses.replace(glide_cfg, kl_weight=kl_weight, distill=distill)


def training_rows(cfg: Config, rows: PackedRows) -> PackedRows:
    """The rows the draft trains on: ``glide.train_rows`` of the training split's,
    spread evenly over it (row ``i * R // n``), or all of them."""
    n = cfg.glide.train_rows
    if n is None:
        return rows
    if n > len(rows):
        raise ValueError(f"glide.train_rows={n} exceeds the training split's {len(rows)} rows")
    index = np.arange(n) * len(rows) // n
    return PackedRows(rows.tokens[index], rows.segment_ids[index], rows.positions[index])


def draft_vocabulary(cfg: Config, rows: PackedRows, run_dir: pathlib.Path) -> DraftVocab | None:
    """The draft's vocabulary for ``glide.draft_vocab=N`` (None when unset): the ``N``
    most frequent tokens of the training split's packed ``rows`` (ties to the lower id),
    or, when ``run_dir`` has one (a resumed run), the one it stored."""
    n = cfg.glide.draft_vocab
    if n is None:
        return None
    stored = pathlib.Path(run_dir) / VOCAB_FILE
    if stored.is_file():
        ids = np.load(stored)
        if len(ids) != n:
            raise ValueError(f"{stored} holds a draft vocabulary of {len(ids)} tokens, not "
                             f"glide.draft_vocab={n}; use another run_dir")
        return DraftVocab(ids, cfg.model.vocab_size)
    return DraftVocab(most_frequent(rows, n, cfg.model.vocab_size), cfg.model.vocab_size)


def most_frequent(rows: PackedRows, n: int, vocab_size: int) -> np.ndarray:
    """The ``n`` most frequent token ids of ``rows`` (ties to the lower id), ascending."""
    counts = np.bincount(rows.tokens.ravel(), minlength=vocab_size)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count, then id
    return np.sort(order[:n])


def save_vocabulary(vocab: DraftVocab | None, run_dir: pathlib.Path) -> None:
    """Keeps the draft's vocabulary in its run dir (``VOCAB_FILE``), for decoding."""
    if vocab is not None:
        np.save(pathlib.Path(run_dir) / VOCAB_FILE, vocab.ids)


def distill_outputs(cfg: Config) -> str | None:
    """What the loss reads of the target's distribution: ``"topk"``, ``"full"``, or
    None without a KL term (``cfg.glide`` resolved for ``cfg.model``'s vocabulary)."""
    glide_cfg = resolve(cfg.glide, cfg.model.vocab_size)
    return glide_cfg.distill if glide_cfg.kl_weight else None


def teacher(target: Transformer, cfg: Config, sharding=None, *, outputs: str | None = None):
    """The jitted ``(target_state, batch) -> batch`` that adds the target's
    teacher-forced keys and values of the layers the draft reads, ``target_k`` and
    ``target_v`` ``[B, T, L_d, K, H]`` (batch first, so the step's batch sharding splits
    them as it splits the tokens), and per ``outputs`` (default ``distill_outputs(cfg)``)
    its float32 log-probabilities: ``"full"``: ``target_logprobs [B, T, V]``;
    ``"topk"``: the ``k = min(glide.teacher_topk, V)`` largest, ``target_topk_logprobs
    [B, T, k]``, and their ids, int32 ``target_topk_ids [B, T, k]``; with
    ``glide.features``, its features ``target_features [B, T, D]`` (final-normed last
    hidden states). ``sharding``: the step's batch sharding, for the outputs (None
    without a mesh).

    One jitted function per target graph (its structure and model config, not its
    weights), layers read, outputs and sharding in a process (``_teacher_program``):
    a second run of the same draft, or a teacher for another target of the same shape,
    calls the program the first compiled instead of tracing the target again."""
    outputs = distill_outputs(dataclasses.replace(cfg, model=target.cfg)) if outputs is None else outputs
    return _teacher_program(nnx.graphdef(target), target.cfg.layers - cfg.glide.layers, outputs,
                            min(cfg.glide.teacher_topk, target.cfg.vocab_size), cfg.glide.features, sharding)


@functools.lru_cache(maxsize=8)
def _teacher_program(graphdef, start: int, outputs: str | None, k: int, features: bool, sharding):
    """``teacher``'s jit for a target of graph ``graphdef`` (hashable, compared by
    structure and static attributes), reading its layers from ``start`` on: everything
    the program depends on besides its arguments' shapes, dtypes and shardings, which
    the jit keys its compiled programs by."""

    def forward(state, batch: Batch) -> Batch:
        model = nnx.merge(graphdef, state)
        B, T = batch["inputs"].shape
        logits, cache, target_features = model.decode(batch["inputs"], init_cache(model.cfg, B, T),
                                                      positions=batch["positions"],
                                                      segment_ids=batch["segment_ids"])
        layers = lambda x: jnp.moveaxis(x[start:], 0, 2)  # [L, B, T, K, H] -> [B, T, L_d, K, H]
        out = dict(batch, target_k=layers(cache.k), target_v=layers(cache.v))
        if features:
            out["target_features"] = target_features
        if outputs is not None:
            logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            if outputs == "full":
                out["target_logprobs"] = logprobs
            else:
                values, ids = jax.lax.top_k(logprobs, k)
                out["target_topk_logprobs"], out["target_topk_ids"] = values, ids.astype(jnp.int32)
        return out

    return jax.jit(forward) if sharding is None else jax.jit(forward, out_shardings=sharding)


class Teacher:
    """What a draft step reads of its target, per batch: ``teacher(split, rows, local)``
    turns this process's loader batch ``local`` (rows ``rows`` of split ``split``'s
    rows) into the step's global batch with the target's keys added. Live: the
    ``teacher`` jit over the batch; with ``cache`` (a ``teacher_cache.TeacherCache`` of
    those rows): the cached arrays, the target never run."""

    def __init__(self, cfg: Config, target: Transformer, target_state, to_global: Callable,
                 sharding=None, cache: teacher_cache.TeacherCache | None = None):
        self.to_global, self.cache, self.state = to_global, cache, target_state
        self.live = teacher(target, cfg, sharding) if cache is None else None
        needed = distill_outputs(dataclasses.replace(cfg, model=target.cfg))
        self.names = (("k", "v") + (("topk_logprobs", "topk_ids") if needed == "topk" else ())
                      + (("features",) if cfg.glide.features else ()))

    def __call__(self, split: str, rows: np.ndarray, local: dict) -> Batch:
        if self.cache is None:
            return self.live(self.state, self.to_global(local))
        return self.to_global({**local, **self.cache.rows(split, rows, self.names)})


def make_teacher(cfg: Config, target: Transformer, target_state, rows: dict[str, PackedRows],
                 tokenizer_json: str, to_global: Callable, sharding=None) -> Teacher:
    """The ``Teacher`` of a run: live, or with ``glide.teacher_cache`` from the cache of
    ``rows`` (split -> the packed rows the run reads), built or completed first when it
    is not there (one ``teacher`` pass over them, in batches of ``batch_size`` rows).

    Raises:
      teacher_cache.TeacherCacheMismatch: the cache was built for another target,
        corpus or layout (one line naming it).
    """
    if cfg.glide.teacher_cache is None:
        return Teacher(cfg, target, target_state, to_global, sharding)
    rows = {split: r for split, r in rows.items() if len(r)}
    data = dataclasses.asdict(dataclasses.replace(cfg.data, tokenizer=None))  # the tokenizer: by content
    layers = range(target.cfg.layers - cfg.glide.layers, target.cfg.layers)
    spec = teacher_cache.spec(target, teacher_cache.params_fingerprint(target), tokenizer_json, data,
                              rows, layers, cfg.glide.teacher_topk, cfg.glide.features)
    live = []  # made on first use: a complete cache never traces the target

    def compute(batch):
        if not live:
            live.append(teacher(target, cfg, sharding, outputs="topk"))
        out = live[0](target_state, to_global(batch))
        return {name: np.asarray(out[teacher_cache.BATCH_KEYS[name]]) for name in spec.arrays}

    cache = teacher_cache.open_cache(cfg.glide.teacher_cache, spec, rows, compute, cfg.batch_size)
    return Teacher(cfg, target, target_state, to_global, sharding, cache)


def make_loss(cfg: Config, target: Transformer):
    """``loss_fn`` for ``cfg.glide`` and ``target``'s structure, as the train step calls
    it: ``(draft, batch, target_state) -> scalar``."""
    glide_cfg = resolve(cfg.glide, target.cfg.vocab_size)
    return functools.partial(loss_fn, target_graphdef=nnx.graphdef(target), block_size=glide_cfg.block_size,
                             kl_weight=glide_cfg.kl_weight, distill=glide_cfg.distill)


def full_kl(target_logp: jax.Array, logits: jax.Array, vocab: DraftVocab | None) -> jax.Array:
    """KL(target || draft) per token ``[B, T]`` from the target's log-probabilities
    ``[B, T, V]`` and the draft's logits ``[B, T, V]`` (``[B, T, N]`` over ``vocab``,
    the target's then restricted to those tokens and renormalised)."""
    if vocab is not None:
        target_logp = jnp.take(target_logp, jnp.asarray(vocab.ids), axis=-1)
        target_logp = target_logp - jax.nn.logsumexp(target_logp, axis=-1, keepdims=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return (jnp.exp(target_logp) * (target_logp - logp)).sum(-1)


def topk_kl(target_logp: jax.Array, target_ids: jax.Array, logits: jax.Array,
            vocab: DraftVocab | None) -> jax.Array:
    """The top-k KL per token ``[B, T]``: KL(p~ || q~) with p~ and q~ the target's and
    the draft's distributions renormalised over the target's top-k tokens (those of
    them in ``vocab``), from its log-probabilities and ids ``[B, T, k]`` and the draft's
    logits ``[B, T, V]`` (``[B, T, N]`` over ``vocab``). 0 where none of the k is in
    ``vocab``."""
    if vocab is None:
        index, inside = target_ids, jnp.ones(target_ids.shape, bool)
    else:
        index, inside = vocab.index(target_ids)
    draft_logits = jnp.take_along_axis(logits.astype(jnp.float32), index, axis=-1)
    # A position with none of its k in the vocabulary is computed over all k (finite
    # values, finite gradients) and then dropped.
    any_inside = inside.any(-1)
    valid = inside | ~any_inside[..., None]
    log_p = target_logp - jax.nn.logsumexp(target_logp, axis=-1, keepdims=True, where=valid)
    log_q = draft_logits - jax.nn.logsumexp(draft_logits, axis=-1, keepdims=True, where=valid)
    terms = jnp.where(valid, jnp.exp(log_p) * (log_p - log_q), 0.0)
    return jnp.where(any_inside, terms.sum(-1), 0.0)


def loss_fn(draft: GlideDraft, batch: Batch, target_state, *, target_graphdef, block_size: int,
            kl_weight: float = 0.0, distill: str = "full") -> jax.Array:
    """The draft's mean next-token loss over the batch's ``mask`` (and, with a draft
    vocabulary, over the targets in it), plus ``kl_weight`` x the mean KL(target ||
    draft) per token when ``kl_weight`` > 0: ``full_kl`` of ``target_logprobs``
    (``distill`` "full") or ``topk_kl`` of ``target_topk_logprobs`` / ``_ids`` ("topk").

    ``batch``: the loader's keys plus ``teacher``'s (or a teacher cache's); the draft's
    queries see the target's keys/values through ``cross_block_mask`` (``block_size`` =
    gamma + 1), and a draft with ``features`` reads ``target_features`` at
    ``feature_sources``. ``target_state``: the target's ``nnx.State``, for its embedding and LM head.
    """
    target = nnx.merge(target_graphdef, target_state)
    positions, segment_ids, mask = batch["positions"], batch.get("segment_ids"), batch.get("mask")
    k = jnp.moveaxis(batch["target_k"], 2, 0)  # [B, T, L_d, K, H] -> [L_d, B, T, K, H]
    v = jnp.moveaxis(batch["target_v"], 2, 0)
    features = None
    if draft.features:  # each position reads the feature of the last position the target ran
        source, has = feature_sources(positions, block_size)
        features = jnp.take_along_axis(batch["target_features"], source[..., None], axis=1)
        features = jnp.where(has[..., None], features, 0)
    logits = draft(batch["inputs"], target, k, v, cross_block_mask(positions, segment_ids, block_size),
                   positions=positions, segment_ids=segment_ids, features=features)
    targets, counted = batch["targets"], mask
    if draft.vocab is not None:  # a target token outside the draft's vocabulary: not its to predict
        targets, inside = draft.vocab.index(targets)
        counted = inside if mask is None else mask * inside
    loss = cross_entropy(logits, targets, counted)
    if kl_weight > 0:
        if distill == "full":
            kl = full_kl(batch["target_logprobs"], logits, draft.vocab)
        else:
            kl = topk_kl(batch["target_topk_logprobs"], batch["target_topk_ids"], logits, draft.vocab)
        loss = loss + kl_weight * masked_mean(kl, mask)
    return loss
