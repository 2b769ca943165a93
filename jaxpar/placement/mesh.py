"""Device meshes with jaxpar's five named axes.

Axes, outermost to innermost: ``data, fsdp, pipe, seq, tensor``. Devices that are
neighbours in ``jax.devices()`` order (same host, same NVLink island) end up on the
innermost axes, so the axes that talk most often sit on the fastest links:

* ``data``   all-reduces gradients once per step (outermost: may cross slow links);
* ``fsdp``   all-gathers each layer's parameters and reduce-scatters its gradients;
* ``pipe``   sends activations between neighbouring stages every microbatch;
* ``seq``    passes keys/values around a ring inside every attention layer;
* ``tensor`` reduces partial sums inside every projection (innermost).

``tensor=(q, q)`` replaces ``tensor`` by the 2D grid ``tensor_row, tensor_col`` of
Optimus/SUMMA tensor parallelism (``tensor_col`` innermost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "pipe", "seq", "tensor")
TENSOR_2D_AXES: tuple[str, str] = ("tensor_row", "tensor_col")
# Expert parallelism (MaxText's `expert` axis: MoE experts split over it). Sharding rules
# may name it and a user's own mesh may have it; ``make_mesh`` does not make it (jaxpar
# has no MoE layers), so on jaxpar's meshes the rules naming it replicate.
EXPERT_AXIS = "expert"
# Every mesh axis name sharding rules may name: a jaxpar mesh's axes, and `expert`.
ALL_AXES: tuple[str, ...] = MESH_AXES + TENSOR_2D_AXES + (EXPERT_AXIS,)


def make_mesh(
    *,
    data: int = 1,
    fsdp: int = 1,
    pipe: int = 1,
    seq: int = 1,
    tensor: int | tuple[int, int] = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Returns a mesh with axes ``("data", "fsdp", "pipe", "seq", "tensor")``, or with
    ``tensor=(q, q)`` the axes ``("data", "fsdp", "pipe", "seq", "tensor_row", "tensor_col")``.

    The product of the sizes must equal the number of devices (``devices``, or all of
    ``jax.devices()``); every axis is present, size 1 when unused, so sharding rules can
    name any of them. Axes are ``AxisType.Auto``: the model states shardings through
    logical-axis rules and XLA's partitioner propagates them (see ``jaxpar.rules``).

    Raises:
      ValueError: a size is not a positive int, a 2D grid is not square with q >= 2,
        or the sizes do not multiply to the device count.
    """
    sizes = {"data": data, "fsdp": fsdp, "pipe": pipe, "seq": seq}
    if isinstance(tensor, (tuple, list)):
        if len(tensor) != 2 or tensor[0] != tensor[1] or not isinstance(tensor[0], int) or tensor[0] < 2:
            raise ValueError(
                f"mesh tensor={tuple(tensor)!r}: a 2D tensor grid must be square, (q, q) with q >= 2"
            )
        sizes |= dict(zip(TENSOR_2D_AXES, tensor))
    else:
        sizes["tensor"] = tensor
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be a positive int")
    devices = list(jax.devices() if devices is None else devices)
    product = math.prod(sizes.values())
    if product != len(devices):
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(
            f"mesh sizes {shown} multiply to {product}, but there are {len(devices)} devices"
        )
    return jax.make_mesh(
        tuple(sizes.values()),
        tuple(sizes),
        axis_types=(AxisType.Auto,) * len(sizes),
        devices=devices,
    )
