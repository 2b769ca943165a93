"""What a transformer run trains, as one interface the loop's ``TransformerTask``
(``jaxpar.train.loop``) calls without asking which: ``LanguageModel`` (``task: lm``)
and ``GlideDraft`` (``task: glide``, a draft for a frozen target, ``jaxpar.train.glide``).

A task gives the loop:

* ``cfg``: the run's config as the task resolves it (a GliDe draft's ``model.*`` and
  ``data.tokenizer`` are its target's);
* ``model()``: the model to train (its parameters random, placed by the caller);
* ``frozen(mesh, rules)``: the state every step takes and never trains (the target's),
  as a tuple of zero or one ``nnx.State``;
* ``step_options(frozen)``: ``make_train_step``'s ``loss`` / ``frozen`` arguments;
* ``initialise(model, frozen)``: the freshly built model before its first step (a draft
  may start from its target's layers);
* ``data()``: ``(tokenizer, train rows, validation rows)``;
* ``batches(...)``: ``batch_of(split, rows, local)``, this process's loader rows made
  the step's global batch (a draft's with the target's keys and values added);
* ``save_files(run_dir)``: what the run dir holds beside checkpoints (the draft's
  vocabulary);
* ``counts_flops``: whether ``flops_per_token`` counts its step (the MFU figure).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

from flax import nnx

import jaxpar
from jaxpar.models import GlideDraft as GlideDraftModel
from jaxpar.models import Remat, Transformer
from jaxpar.train import data as data_lib
from jaxpar.train import glide, self_distill
from jaxpar.train.config import Config


def build_model(cfg: Config, vocab=None) -> nnx.Module:
    """The model a run trains: the ``Transformer``, or with ``task: glide`` the GliDe
    draft for the target's model config (``cfg.model``) over ``vocab`` (a
    ``jaxpar.models.glide.DraftVocab``, or None: the whole vocabulary), its layers
    rematerialised as ``cfg.layout`` says."""
    remat = Remat(cfg.layout.remat, cfg.layout.remat_names)
    if cfg.task == "glide":
        return GlideDraftModel(cfg.model, cfg.glide.layers, vocab=vocab, features=cfg.glide.features,
                               rngs=nnx.Rngs(cfg.seed), remat=remat)
    return Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed), remat=remat)


def load_data(cfg: Config, target: Transformer | None = None, *, progress: bool = False) -> tuple:
    """``(tokenizer, train rows, validation rows)`` of the run, from ``cache_dir`` when
    an earlier run made them. With ``glide.self_distill``, the rows are ``target``'s
    own continuations of the splits' prompts (``jaxpar.train.self_distill``)."""
    cache_dir = data_lib.cache_dir_of(cfg.cache_dir)
    tokenizer = data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size, cache_dir)
    data_lib.check_vocab(tokenizer, cfg.model.vocab_size)
    if cfg.task == "glide" and cfg.glide.self_distill:
        if target is None:
            raise ValueError("glide.self_distill rows are the target's continuations: load_data needs the target")
        return tokenizer, *self_distill.load_rows(cfg, target, tokenizer, cache_dir, progress=progress)
    train_rows = data_lib.packed_rows(cfg.data, tokenizer, cfg.seq_len, "train", cache_dir)
    val_rows = data_lib.packed_rows(cfg.data, tokenizer, cfg.seq_len, "validation", cache_dir)
    return tokenizer, train_rows, val_rows


class LanguageModel:
    """``task: lm``: a ``Transformer`` trained on next-token prediction."""

    counts_flops = True

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def model(self) -> nnx.Module:
        return build_model(self.cfg)

    def frozen(self, mesh, rules) -> tuple:
        return ()

    def step_options(self, frozen: tuple) -> dict:
        return {}

    def initialise(self, model: nnx.Module, frozen: tuple) -> nnx.Module:
        return model

    def data(self) -> tuple:
        return load_data(self.cfg)

    def batches(self, tokenizer, train_rows, val_rows, frozen: tuple, to_global: Callable, sharding) -> Callable:
        return lambda split, rows, local: to_global(local)

    def save_files(self, run_dir: pathlib.Path) -> None:
        pass


class GlideDraft:
    """``task: glide``: a GliDe draft for the frozen target in ``target_run_dir``. Its
    rows are read (and its vocabulary counted) when it is made, before the mesh."""

    counts_flops = False  # flops_per_token counts a Transformer's step, not the draft's and teacher's

    def __init__(self, cfg: Config, *, progress: bool):
        self.cfg, self.target = glide.prepare(cfg)  # model.* and data.tokenizer become the target's
        self._data = load_data(self.cfg, self.target, progress=progress)
        # the draft's vocabulary is counted on its training split (or read from the run dir)
        self.vocab = glide.draft_vocabulary(self.cfg, self._data[1], pathlib.Path(self.cfg.run_dir))

    def model(self) -> nnx.Module:
        return build_model(self.cfg, self.vocab)

    def frozen(self, mesh, rules) -> tuple:
        """The target's state: an argument of every step, never trained."""
        return (nnx.state(jaxpar.shard_model(self.target, mesh, rules)),)

    def step_options(self, frozen: tuple) -> dict:
        return {"loss": glide.make_loss(self.cfg, self.target), "frozen": frozen[0]}

    def initialise(self, model: nnx.Module, frozen: tuple) -> nnx.Module:
        if self.cfg.glide.init == "target":
            model.start_from_target(nnx.merge(nnx.graphdef(self.target), *frozen))
        return model

    def data(self) -> tuple:
        """The rows the draft trains on are ``glide.train_rows`` of its split's."""
        tokenizer, train_rows, val_rows = self._data
        return tokenizer, glide.training_rows(self.cfg, train_rows), val_rows

    def batches(self, tokenizer, train_rows, val_rows, frozen: tuple, to_global: Callable, sharding) -> Callable:
        """With the target's keys/values, computed outside the step (or cached): over
        the rows the draft trains on and the validation rows evaluation reads."""
        cfg = self.cfg
        val_count = cfg.eval.batches * cfg.batch_size if cfg.eval.every else 0
        val_used = data_lib.PackedRows(*(a[:val_count] for a in dataclasses.astuple(val_rows)))
        return glide.make_teacher(cfg, self.target, frozen[0], {"train": train_rows, "validation": val_used},
                                  tokenizer.to_str(), to_global, sharding)

    def save_files(self, run_dir: pathlib.Path) -> None:
        glide.save_vocabulary(self.vocab, run_dir)


def of(cfg: Config, *, progress: bool = False) -> LanguageModel | GlideDraft:
    """The task ``cfg.task`` names: ``lm`` or ``glide`` (``dlrm``'s is ``jaxpar.train.recsys``'s)."""
    return GlideDraft(cfg, progress=progress) if cfg.task == "glide" else LanguageModel(cfg)
