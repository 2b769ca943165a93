"""jaxpar: large-model training and serving in JAX's SPMD world.

Dimension letters used in shape comments and einsums throughout the package (the
scaling book's): B batch, T query length, S key/value length, D model width, F MLP
width, N query heads, K key/value heads, H head dim, V vocabulary, L layers.
"""

from jaxpar import profiler, rules
from jaxpar.attention import dot_product_attention
from jaxpar.mesh import MESH_AXES, make_mesh
from jaxpar.sequence_parallel import ring_attention
from jaxpar.sharding import constrain, model_shardings, shard_model, use_mesh
from jaxpar.summa import summa_matmul

__version__ = "0.1.0"

__all__ = [
    "MESH_AXES",
    "constrain",
    "dot_product_attention",
    "make_mesh",
    "model_shardings",
    "profiler",
    "ring_attention",
    "rules",
    "shard_model",
    "summa_matmul",
    "use_mesh",
]
