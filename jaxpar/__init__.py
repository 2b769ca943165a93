"""jaxpar: large-model training and serving in JAX's SPMD world.

Dimension letters used in shape comments and einsums throughout the package (the
scaling book's): B batch, T query length, S key/value length, D model width, F MLP
width, N query heads, K key/value heads, H head dim, V vocabulary, L layers.

Layout, one subpackage per concern, imports pointing one way only (``import-linter``
holds it in CI; contracts in ``pyproject.toml``)::

    jaxpar.kernels                       Pallas kernels and their plain-jnp references
      <- jaxpar.placement, jaxpar.profiler  meshes, rules, sharding; compile-only profiles
      <- jaxpar.parallel                 SUMMA, ring/Ulysses attention, pipeline
      <- jaxpar.ops                      attention / linear / kernel entry points
      <- jaxpar.layout                   one parallel layout: mesh, pipeline, remat, accumulation, offload
      <- jaxpar.models                   the transformer, GliDe draft, HF import
      <- jaxpar.inference                decoding, speculative decoding
      <- jaxpar.serving                  paged KV cache, continuous batching, the HTTP app
      <- jaxpar.train                    training: the loop, the step, data, checkpoints, tasks
      <- jaxpar.cluster                  training jobs on Ray, jaxpar.elastic scheduling them
      <- jaxpar.commands                 the jaxpar-* command lines

Nothing below ``jaxpar.models`` imports a model: the core sees arrays, rules and meshes.
"""

from jaxpar import profiler
from jaxpar.placement import rules
from jaxpar.ops.attention import dot_product_attention
from jaxpar.placement.execution import Execution, SequenceOptions, jit, use_execution
from jaxpar.placement.linen import linen_shardings
from jaxpar.placement.mesh import MESH_AXES, make_mesh
from jaxpar.parallel.sequence import ring_attention
from jaxpar.placement.sharding import auto_axes, constrain, model_shardings, shard_model, use_mesh
from jaxpar.parallel.summa import summa_matmul

__version__ = "0.1.0"

__all__ = [
    "Execution",
    "MESH_AXES",
    "SequenceOptions",
    "auto_axes",
    "constrain",
    "dot_product_attention",
    "jit",
    "linen_shardings",
    "make_mesh",
    "model_shardings",
    "profiler",
    "ring_attention",
    "rules",
    "shard_model",
    "summa_matmul",
    "use_execution",
    "use_mesh",
]
