"""Reading finished runs back: a ``jaxpar-train`` run directory (``config.yaml``,
``tokenizer.json``, orbax ``checkpoints/``), a Hugging Face Llama directory
(``config.json``, ``*.safetensors``, ``tokenizer.json``) or a llama.cpp ``.gguf`` file
(weights, tokenizer and end tokens in one file), as ``jaxpar-generate`` and the GliDe
trainer load their target and draft models; ``load_glide_draft`` reads a
``jaxpar-train glide`` run."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import tokenizers
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxpar.models import GlideDraft, Transformer, from_gguf, from_hf
from jaxpar.models.glide import DraftVocab
from jaxpar.models.gguf import gguf_metadata, gguf_tokenizer, is_gguf, save_as_hf
from jaxpar.train.checkpoints import Checkpoints
from jaxpar.train.config import Config, load_config
from jaxpar.train.data import EOS, cache_dir_of
from jaxpar.train.glide import VOCAB_FILE


def check_run_dir(run_dir: pathlib.Path) -> None:
    """Raises ``FileNotFoundError`` saying what is wrong where ``run_dir`` is neither a
    jaxpar run (``config.yaml``), a Hugging Face directory (``config.json``) nor a
    ``.gguf`` file: it does not exist, is another file, or a directory holding neither."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"{run_dir} does not exist")
    if is_gguf(run_dir):
        return
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory (nor a .gguf file)")
    if not ((run_dir / "config.yaml").is_file() or (run_dir / "config.json").is_file()):
        raise FileNotFoundError(f"no config.yaml (a jaxpar run) or config.json (Hugging Face) in {run_dir}")


def as_hf(run_dir: pathlib.Path, cache_dir=None) -> pathlib.Path:
    """``run_dir`` itself, or for a ``.gguf`` file the Hugging Face directory it is
    converted into once (``models.gguf.save_as_hf``, in ``CACHE_DIR/gguf``, keyed by the
    file's path, size and modification time; ``cache_dir`` as the commands'
    ``--cache-dir``): every later load reads float32 safetensors instead of parsing the
    file's vocabulary and dequantizing its tensors again (SmolLM2-135M's Q4_1 file: 5-10
    s each start, 0.5 s from the directory). The directory is written under a temporary
    name and renamed, so a start stopped halfway leaves nothing half-written behind."""
    run_dir = pathlib.Path(run_dir)
    if not is_gguf(run_dir):
        return run_dir
    stat = run_dir.resolve().stat()
    key = hashlib.sha256(f"{run_dir.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir_of(cache_dir) / "gguf" / f"{run_dir.stem}-{key}"
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.parent / f".{out.name}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        save_as_hf(run_dir, partial)
        try:
            partial.rename(out)
        except OSError:  # another process converted it first
            shutil.rmtree(partial, ignore_errors=True)
    return out


def is_hf(run_dir: pathlib.Path) -> bool:
    """A Hugging Face directory (``config.json``) rather than a jaxpar run (``config.yaml``)."""
    run_dir = pathlib.Path(run_dir)
    return (run_dir / "config.json").is_file() and not (run_dir / "config.yaml").is_file()


def read_config(run_dir: pathlib.Path) -> Config:
    """The resolved config a jaxpar run wrote (``RUN_DIR/config.yaml``)."""
    check_run_dir(run_dir)
    if is_gguf(run_dir):
        raise FileNotFoundError(f"{run_dir} is a GGUF file, not a jaxpar run")
    path = pathlib.Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no config.yaml in {run_dir}: a Hugging Face directory, not a jaxpar run")
    return load_config(str(path))


def load_tokenizer(run_dir: pathlib.Path) -> tokenizers.Tokenizer:
    """A run's or Hugging Face directory's ``tokenizer.json``, or a GGUF file's tokenizer."""
    check_run_dir(run_dir)
    if is_gguf(run_dir):
        return gguf_tokenizer(run_dir)
    path = pathlib.Path(run_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {run_dir}")
    return tokenizers.Tokenizer.from_file(str(path))


def eos_ids(run_dir: pathlib.Path, tokenizer: tokenizers.Tokenizer) -> tuple[int, ...]:
    """The end-of-sequence token ids generation stops at, as ``transformers`` stops.

    A jaxpar run: the tokenizer's end-of-text token (``jaxpar.train.data.EOS``). A Hugging
    Face directory: ``generation_config.json``'s ``eos_token_id`` (an int or a list, as
    Llama 3 has), else ``config.json``'s, else ``tokenizer_config.json``'s ``eos_token``
    looked up in ``tokenizer``; ``()`` (no stop) when none names one. A GGUF file: its
    end-of-sequence, end-of-turn and end-of-message ids (``gguf_metadata``).
    """
    run_dir = pathlib.Path(run_dir)
    if is_gguf(run_dir):
        return gguf_metadata(run_dir).eos_ids
    if not is_hf(run_dir):
        eos = tokenizer.token_to_id(EOS)
        return () if eos is None else (eos,)
    for name in ("generation_config.json", "config.json"):
        path = run_dir / name
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        if ids is not None:
            ids = ids if isinstance(ids, list) else [ids]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"eos_token_id={ids!r} in {path} must be a token id or a list of them")
            return tuple(ids)
    path = run_dir / "tokenizer_config.json"
    token = json.loads(path.read_text()).get("eos_token") if path.is_file() else None
    if isinstance(token, dict):  # an AddedToken: {"content": "</s>", ...}
        token = token.get("content")
    eos = tokenizer.token_to_id(token) if isinstance(token, str) else None
    return () if eos is None else (eos,)


def restore_params(run_dir: pathlib.Path, model: nnx.Module, cfg: Config, step: int | None = None
                   ) -> nnx.Module:
    """Fills ``model`` (abstract, ``nnx.eval_shape``) with the parameters of the latest
    readable checkpoint in ``run_dir`` (or of ``step``'s), on one device; the optimizer
    state stays on disk."""
    device = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nnx.state(model))
    with Checkpoints(run_dir, keep=cfg.checkpoint.keep) as checkpoints:
        restored = checkpoints.restore_params(abstract, step)
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {pathlib.Path(run_dir) / 'checkpoints'}")
    nnx.update(model, restored[1])
    return model


def load_run(run_dir: pathlib.Path) -> Transformer:
    """The model of the latest readable checkpoint in a jaxpar run dir, on one device."""
    cfg = read_config(run_dir)
    if cfg.task == "glide":
        raise ValueError(f"{run_dir} holds a GliDe draft (task='glide'), not a language model; its "
                         f"target is {cfg.target_run_dir}")
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return restore_params(run_dir, model, cfg)


def load_model(run_dir: pathlib.Path) -> Transformer:
    """A jaxpar run's model, a Hugging Face model (``from_hf``) or a GGUF file's
    (``from_gguf``), on one device."""
    check_run_dir(run_dir)
    if is_gguf(run_dir):
        return from_gguf(run_dir)
    return from_hf(run_dir) if is_hf(run_dir) else load_run(run_dir)


def context_length(run_dir: pathlib.Path, model: Transformer) -> int:
    """The most tokens, prompt and generated together, that ``model`` (as ``load_model``
    read it from ``run_dir``) reads in one sequence: a Hugging Face model's
    ``max_position_embeddings`` (a GGUF file's ``context_length``); a jaxpar run's ``seq_len``, the positions it was trained
    on (with learned positions, no more than the table's ``model.max_position`` rows)."""
    if is_hf(run_dir) or is_gguf(run_dir):
        return model.cfg.max_position
    seq_len = read_config(run_dir).seq_len
    return min(seq_len, model.cfg.max_position) if model.cfg.position == "learned" else seq_len


def load_glide_draft(run_dir: pathlib.Path, step: int | None = None) -> GlideDraft:
    """The GliDe draft of the latest readable checkpoint in a ``jaxpar-train glide`` run
    dir (or of ``step``'s), on one device. Its ``cfg`` is the target's model config it was trained for (the
    run's ``model``); the target itself is ``load_model(read_config(run_dir).target_run_dir)``.

    A draft trained with ``glide.draft_vocab=N`` predicts over the ``N`` tokens its run
    keeps in ``draft_vocab.npy`` (``GlideDraft.vocab``).

    Raises:
      ValueError: the run is not a GliDe run.
      FileNotFoundError: no config, checkpoint or (with ``glide.draft_vocab``) vocabulary.
    """
    cfg = read_config(run_dir)
    if cfg.task != "glide":
        raise ValueError(f"{run_dir} is not a GliDe draft run (task={cfg.task!r}); train one with "
                         "jaxpar-train glide target_run_dir=TARGET")
    vocab = None
    if cfg.glide.draft_vocab is not None:
        path = pathlib.Path(run_dir) / VOCAB_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {VOCAB_FILE} in {run_dir} (a draft with glide.draft_vocab="
                                    f"{cfg.glide.draft_vocab})")
        vocab = DraftVocab(np.load(path), cfg.model.vocab_size)
    model = nnx.eval_shape(lambda: GlideDraft(cfg.model, cfg.glide.layers, vocab=vocab,
                                                   features=cfg.glide.features, rngs=nnx.Rngs(0)))
    return restore_params(run_dir, model, cfg, step)
