"""What one training step computes, independent of its layout: the model's shapes, the
global batch and the sequence length, and the per-device parameter shards a layout
gives (exact, from the model's own annotations and sharding rules, on an abstract
mesh of any size: no devices needed)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from flax import nnx

from jaxpar.inputs import InputError
from jaxpar.models.config import ModelConfig
from jaxpar.models.transformer import Transformer, sharding_rules
from jaxpar.placement import rules as rules_lib
from jaxpar.placement.sharding import logical_axes


class LayoutError(InputError):
    """A layout the model's shapes cannot take (a dimension that does not divide)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    model: ModelConfig
    batch_size: int  # global, in sequences
    seq_len: int

    def __hash__(self) -> int:  # computed once: the planner's caches hash it per candidate
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash((self.model, self.batch_size, self.seq_len))
            object.__setattr__(self, "_hash", h)
            return h

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @functools.cached_property
    def matmul_params(self) -> int:
        """Parameters of the matmuls a token runs through (the head, not the lookup; in a
        MoE layer the router, its ``k`` experts and the shared ones: active parameters)."""
        m = self.model
        attention = m.dim * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.dim
        dense = m.layers - self.moe_layers
        moe_mlp = 0
        if self.moe_layers:
            e = m.moe
            moe_mlp = m.dim * e.experts + (e.experts_per_token + e.shared_experts) * self.expert_params
        return (m.vocab_size * m.dim + m.layers * attention + dense * m.dim * m.mlp_dim * self.gates
                + self.moe_layers * moe_mlp)

    @property
    def gates(self) -> int:
        """Weight matrices of an MLP (SwiGLU's gate, up and down; GELU's up and down)."""
        return 3 if self.model.mlp == "swiglu" else 2

    @property
    def moe_layers(self) -> int:
        m = self.model
        return 0 if m.moe is None else m.layers // m.moe.every

    def routed_rows(self, expert: int, ragged: bool = False) -> int:
        """Rows a token puts through a MoE layer's grouped matmuls on ``expert`` devices:
        its ``k`` copies, or with expert parallelism the fixed per-destination buffers'
        ``W x min(k, E / W)`` (``jaxpar.models.moe.exchange``); ``ragged``: its ``k``
        copies whatever ``expert`` (``exchange_ragged`` on a GPU or TPU, whose grouped
        matmuls read the group sizes and skip the buffers' empty rows)."""
        e = self.model.moe
        if expert > 1 and not ragged:
            return expert * min(e.experts_per_token, e.experts // expert)
        return e.experts_per_token

    @property
    def expert_params(self) -> int:
        """One expert's weights (0 for a dense model)."""
        m = self.model
        return 0 if m.moe is None else self.gates * m.dim * m.moe.expert_width

    def model_flops(self) -> float:
        """Training FLOPs of one step as MFU counts them (PaLM's: 6 per matmul parameter
        per token, plus 12 L N H T per token for attention's two products)."""
        m = self.model
        return self.tokens * (6 * self.matmul_params + 12 * m.layers * m.heads * m.head_dim * self.seq_len)

    def attention_flops(self) -> float:
        """The attention products' share of ``model_flops`` (forward and backward)."""
        m = self.model
        return self.tokens * 12 * m.layers * m.heads * m.head_dim * self.seq_len

    @functools.cached_property
    def abstract_params(self) -> list[tuple[str, tuple[int, ...], int, tuple]]:
        """``(path, shape, itemsize, logical axes)`` of every parameter."""
        model = nnx.eval_shape(lambda: Transformer(self.model, rngs=nnx.Rngs(0)))
        out = []
        for path, var in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                                             is_leaf=lambda x: isinstance(x, nnx.Variable)):
            value = var.get_value()
            out.append(("/".join(str(getattr(k, "key", k)) for k in path), tuple(value.shape),
                        value.dtype.itemsize, logical_axes(var)))
        return out


def abstract_mesh(sizes: dict[str, int]) -> jax.sharding.AbstractMesh:
    return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))


@functools.lru_cache(maxsize=4096)
def _shards(work: Workload, sizes: tuple[tuple[str, int], ...], sequence_parallel: bool) -> dict[str, int]:
    mesh = abstract_mesh(dict(sizes))
    rules = sharding_rules(work.model, mesh, sequence_parallel=sequence_parallel)
    out = {"params": 0, "layer_params": 0, "replicated_params": 0, "elements": 0}
    specs: dict = {}  # logical axes -> spec: the parameters share a few
    for path, shape, itemsize, names in work.abstract_params:
        if names and names not in specs:
            specs[names] = rules_lib.logical_to_spec(names, rules)
        spec = specs[names] if names else (None,) * len(shape)
        local = []
        for dim, axes in zip(shape, spec):
            ways = math.prod(mesh.shape[a] for a in rules_lib.as_tuple(axes))
            if dim % ways:
                raise LayoutError(f"parameter {path} {shape}: dimension {dim} does not divide by "
                                  f"{'x'.join(rules_lib.as_tuple(axes))}={ways}")
            local.append(dim // ways)
        size = math.prod(local)
        out["params"] += size * itemsize
        out["elements"] += size
        if path.startswith("layers"):
            out["layer_params"] += size * itemsize
        if size == math.prod(shape):
            out["replicated_params"] += size * itemsize
    return out


def shards(work: Workload, sizes: dict[str, int], sequence_parallel: bool = False) -> dict[str, int]:
    """Per-device parameter bytes under the model's rules on a mesh of ``sizes``:
    ``params`` (all), ``layer_params`` (the stacked layers'), ``elements``.

    Raises:
      LayoutError: a parameter dimension does not divide by its mesh axes.
    """
    return _shards(work, tuple(sizes.items()), sequence_parallel)
