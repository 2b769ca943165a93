"""Device meshes with jaxpar's five named axes, and ``expert`` where MoE layers split their
experts.

Axes, outermost to innermost: ``data, fsdp, [expert,] pipe, seq, tensor``. Devices that are
neighbours in ``jax.devices()`` order (same host, same NVLink island) end up on the
innermost axes, so the axes that talk most often sit on the fastest links:

* ``data``   all-reduces gradients once per step (outermost: may cross slow links);
* ``fsdp``   all-gathers each layer's parameters and reduce-scatters its gradients;
* ``expert`` exchanges each MoE layer's tokens by all-to-all, twice a layer, and is
  data-parallel elsewhere (next to ``data`` and ``fsdp``, as in MaxText, so the batch's
  axes are adjacent); present only when above 1 (``make_mesh(expert=)``);
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
# Expert parallelism (MaxText's `expert` axis: MoE experts split over it). ``make_mesh``
# makes it only when ``expert`` > 1, so meshes without MoE layers keep their five axes; on
# those the rules naming it replicate.
EXPERT_AXIS = "expert"
# Every mesh axis name sharding rules may name: a jaxpar mesh's axes, and `expert`.
ALL_AXES: tuple[str, ...] = MESH_AXES + TENSOR_2D_AXES + (EXPERT_AXIS,)
# make_mesh's axis_types: what each name gives every axis of the mesh.
AXIS_TYPES: dict[str, AxisType] = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def make_mesh(
    *,
    data: int = 1,
    fsdp: int = 1,
    expert: int = 1,
    pipe: int = 1,
    seq: int = 1,
    tensor: int | tuple[int, int] = 1,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str = "auto",
) -> Mesh:
    """Returns a mesh with axes ``("data", "fsdp", "pipe", "seq", "tensor")``, or with
    ``tensor=(q, q)`` the axes ``("data", "fsdp", "pipe", "seq", "tensor_row", "tensor_col")``;
    with ``expert`` > 1, ``"expert"`` after ``"fsdp"``.

    The product of the sizes must equal the number of devices (``devices``, or all of
    ``jax.devices()``); every axis is present, size 1 when unused, so sharding rules can
    name any of them.

    ``axis_types`` gives every axis one type (``jax.sharding.AxisType``):

    * ``"auto"`` (the default): the model states shardings through logical-axis rules
      (``jaxpar.constrain``) and XLA's partitioner propagates them to everything else.
    * ``"explicit"``: a sharding is part of each array's type (``jax.typeof(x)``), and
      code written for Explicit sharding (``jnp.einsum(..., out_sharding=P(...))``,
      ``jax.sharding.reshard``) runs as it is written. ``jaxpar.constrain`` then
      reshards rather than constrains. jaxpar's own model is written for Auto axes (its
      matmuls leave their shardings to propagation), so its loss
      (``jaxpar.train.step.loss_fn``, and the pipelined step) runs under
      ``jaxpar.auto_axes``: on an Explicit mesh with the axes made Auto
      (``jax.sharding.auto_axes``), returning its loss replicated, while parameters,
      gradients, optimizer state and the batch keep their Explicit types around it.
      Wrap your own losses of jaxpar's models the same way. A model annotated with
      mesh axes rather than logical names takes ``jaxpar.rules.identity(mesh)``.

    Raises:
      ValueError: a size is not a positive int, a 2D grid is not square with q >= 2,
        the sizes do not multiply to the device count, or ``axis_types`` is neither
        ``"auto"`` nor ``"explicit"``.
    """
    if not isinstance(axis_types, str) or axis_types not in AXIS_TYPES:
        raise ValueError(f"mesh axis_types={axis_types!r} must be one of {list(AXIS_TYPES)}")
    if isinstance(expert, bool) or not isinstance(expert, int) or expert < 1:
        raise ValueError(f"mesh axis expert={expert!r} must be a positive int")
    sizes = {"data": data, "fsdp": fsdp} | ({EXPERT_AXIS: expert} if expert > 1 else {}) | {"pipe": pipe, "seq": seq}
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
        axis_types=(AXIS_TYPES[axis_types],) * len(sizes),
        devices=devices,
    )
