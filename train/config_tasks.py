"""The configuration sections of the tasks beside language modelling: the GliDe draft
(``glide.*``, ``task: glide``) and DLRM's embedding tables (``embedding.*``, ``task:
dlrm``). ``jaxpar.train.config.Config`` holds them; they are read, checked and written
as its other sections are."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from jaxpar.offload.budget import parse_bytes


@dataclasses.dataclass(frozen=True)
class GlideConfig:
    """With ``task: glide``: the GliDe draft (``jaxpar.models.glide``) trained for the
    target in ``target_run_dir`` (``jaxpar.train.glide`` resolves the ``None`` and
    ``auto`` settings against the target and records the result in the run's
    ``config.yaml``)."""

    layers: int = 1  # L_d, the draft's decoder layers; they read the target's last L_d
    # Where the draft's layers start: "target", the target layers they read
    # (GlideDraft.start_from_target; cross-attention from that layer's attention), or
    # "random" (the model's init_std).
    init: Literal["target", "random"] = "target"
    # Tokens per block of the training cross mask, gamma + 1: a draft token sees the
    # target's keys/values of the blocks before its own (jaxpar.models.glide.cross_block_mask).
    block_size: int = 5
    # Weight of KL(target || draft) per token, added to the next-token loss; 0: none.
    # None: 1.0 for a target with a large vocabulary (jaxpar.train.glide.LARGE_VOCAB
    # tokens or more: distillation from its top-k on by default), else 0.
    kl_weight: float | None = None
    # What the KL term reads of the target: "full" (its whole distribution, live),
    # "topk" (its top teacher_topk log-probabilities, renormalised over them), or
    # "auto": topk for a large vocabulary or with a teacher_cache, else full.
    distill: Literal["auto", "full", "topk"] = "auto"
    # Top-k of the target's distribution that distillation (and the teacher cache) keeps.
    teacher_topk: int = 64
    # A directory holding the target's keys/values and top-k log-probabilities of the
    # training rows (jaxpar.train.teacher_cache), built on first use and reused: a
    # draft step then never runs the target.
    teacher_cache: str | None = None
    # Packed training rows the draft trains on, spread evenly over the training split
    # (None: all); with a teacher_cache, the rows it holds.
    train_rows: int | None = None
    # The draft predicts over the draft_vocab most frequent tokens of the training split
    # (its head: those rows of the target's); None: the whole vocabulary.
    draft_vocab: int | None = None
    # Feed the draft the target's features (its final-normed last hidden state at the
    # last position it verified: EAGLE's input, jaxpar.models.glide.feature_sources)
    # beside each token's embedding. The teacher cache then holds them too.
    features: bool = False
    # Train on the target's own greedy continuations instead of the corpus' text
    # (jaxpar.train.self_distill): each document of a split is one prompt, its first
    # prompt_tokens tokens, continued by the target to seq_len + 1 tokens (generated in
    # batches of generate_batch prompts, once, and cached in cache_dir).
    self_distill: bool = False
    prompt_tokens: int = 64
    generate_batch: int = 64

    def __post_init__(self):
        if self.teacher_cache is not None:  # "~/cache" as a user types it
            object.__setattr__(self, "teacher_cache", os.path.expanduser(self.teacher_cache))
        if self.layers < 1:
            raise ValueError(f"glide.layers={self.layers!r} must be at least 1")
        if self.block_size < 2:
            raise ValueError(f"glide.block_size={self.block_size!r} must be at least 2 (gamma + 1)")
        if self.kl_weight is not None and not self.kl_weight >= 0:  # NaN too
            raise ValueError(f"glide.kl_weight={self.kl_weight!r} must not be negative")
        for key in ("teacher_topk", "train_rows", "draft_vocab", "prompt_tokens", "generate_batch"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"glide.{key}={value!r} must be at least 1")
        if self.distill == "full" and self.teacher_cache is not None:
            raise ValueError("glide.distill='full' reads the live target's whole distribution; a "
                             "glide.teacher_cache keeps its top-k: use glide.distill=topk (or auto)")


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """With ``task: dlrm``, where the embedding tables live and how their rows train
    (``jaxpar.embedding``; the dense layers train with ``optimizer.*``)."""

    # Share of the table's rows cached on the device, in (0, 1] (1: every row), with the
    # whole table and its optimizer state in host memory; "auto": the most rows that
    # device_budget holds; null: no cache, the whole table a device array.
    cache_ratio: float | Literal["auto"] | None = 0.01
    # Share of the cache preloaded with the rows a sample of the training ids uses most
    # (Colossal-AI's warm-up; 0.7 is its default).
    warmup_ratio: float = 0.7
    # Batches ahead whose missing rows a host thread gathers while a step runs (0: none).
    prefetch: int = 1
    eviction: Literal["lfu", "lru"] = "lfu"
    # The sparse rule of the table's rows (only the rows a batch touched change):
    # row-wise Adagrad, as DLRM trains its tables, or plain SGD.
    optimizer: Literal["adagrad", "sgd"] = "adagrad"
    lr: float = 0.05
    # Device bytes for the cache with cache_ratio=auto ("4GiB"; null: the device's own
    # memory where the backend says, which a CPU does not).
    device_budget: str | None = None
    # The table over mesh.data's devices: replicated on each (a cache: the same rows on
    # each), or split (TorchRec's row_wise: equal blocks of rows; table_wise: whole
    # tables, largest first onto the emptiest device), lookups and updates by all-to-all;
    # with a cache, each device caches cache_ratio of its own shard.
    sharding: Literal["replicated", "row_wise", "table_wise"] = "replicated"

    def __post_init__(self):
        ratio = self.cache_ratio
        if ratio is not None and ratio != "auto" and not 0 < ratio <= 1:
            raise ValueError(f"embedding.cache_ratio={ratio!r} must be in (0, 1], auto or null")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"embedding.warmup_ratio={self.warmup_ratio!r} must be in [0, 1]")
        if self.prefetch < 0:
            raise ValueError(f"embedding.prefetch={self.prefetch!r} must not be negative")
        if not self.lr > 0:
            raise ValueError(f"embedding.lr={self.lr!r} must be positive")
        if self.device_budget is not None:
            parse_bytes(self.device_budget, name="embedding.device_budget")
