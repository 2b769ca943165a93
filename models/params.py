"""The parameters of a ``ModelConfig``'s modules (``jaxpar.models.transformer``, ``moe``,
``glide``): initialised in the config's weight dtype and annotated with logical axis
names; sharding is left to ``shard_model``."""

from __future__ import annotations

from flax import nnx

from jaxpar.models.config import ModelConfig


def param(rngs: nnx.Rngs, cfg: ModelConfig, shape, names, init=None) -> nnx.Param:
    """A parameter of ``shape`` with logical axes ``names``; ``init`` defaults to normal
    noise of ``cfg.init_std``."""
    init = init or nnx.initializers.normal(cfg.init_std)
    annotated = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(annotated(rngs.params(), shape, cfg.weight_dtype))


def zeros(rngs, cfg, shape, names):
    return param(rngs, cfg, shape, names, nnx.initializers.zeros_init())


def ones(rngs, cfg, shape, names):
    return param(rngs, cfg, shape, names, nnx.initializers.ones_init())
