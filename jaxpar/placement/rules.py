"""Logical-axis sharding rules: which mesh axes each named array dimension is split over.

A rule table is plain data, a sequence of ``(logical_axis_name, mesh_axes)`` pairs, where
``mesh_axes`` is a mesh axis name, a tuple of them, or ``None`` (replicated). That is the
format of Flax's own ``flax.linen.logical_axis_rules`` and of NNX's ``sharding_rules``, so
other Flax projects can import the table as it is::

    import jaxpar, flax.linen as nn
    mesh = jaxpar.make_mesh(fsdp=8)
    with jax.set_mesh(mesh), nn.logical_axis_rules(jaxpar.rules.for_mesh(mesh)):
        ...

The logical names are MaxText's, the ecosystem's common vocabulary. Parameters:

  ``vocab`` V, ``embed`` D, ``heads`` N, ``kv_heads`` K, ``kv`` H (head dim),
  ``mlp`` F, ``layers`` L (the stacked-layer axis), ``norm`` (norm scales),
  ``positions`` (rows of a learned position table).

Inputs: ``batch`` B, ``length`` T. Activations: the same names prefixed ``activation_``.

jaxpar resolves names strictly, unlike Flax, which replicates what it does not know:

* a logical name without a rule is an error that lists the known names (replication is
  asked for by a rule mapping the name to ``None``);
* a rule naming a mesh axis that neither jaxpar's meshes nor the given mesh has (a typo
  such as ``fdsp``) is an error;
* two dimensions of one array mapped to the same mesh axis is an error.

MaxText's vocabulary: ``DEFAULT_RULES`` has a rule for every logical name of
MaxText's ``base.yml`` (dense layers, attention and MLA, MoE, the inference caches and
pages, layer groups), with MaxText's meaning on jaxpar's axes, as ``from_maxtext`` maps
MaxText's mesh axes (``context`` -> ``seq``, ``stage`` -> ``pipe``, ``expert`` ->
``expert``). Where MaxText's rule differs from jaxpar's, jaxpar keeps its own, and the
names that are variants of it follow it:

* ``norm`` is the norm-scale parameter ``[D]``, and ``activation_embed`` the residual
  stream's width (with ``activation_embed_attn``, ``activation_embed_moe``): MaxText
  splits both over ``tensor``; jaxpar replicates both, as Megatron keeps the residual
  stream whole across the tensor group (``SEQUENCE_PARALLEL`` splits its length there
  instead), and a norm needs its whole scale on every device.
* ``activation_kv`` (and ``activation_kv_head_dim``), the head dimension of attention's
  ``[B, T, N, H]`` activations: MaxText's rule says ``tensor``, but each MaxText array
  with it has heads too, whose earlier rule takes ``tensor``, and flax then leaves the
  head dimension whole. jaxpar reports two dimensions on one axis rather than dropping
  one, so its rule says what MaxText gets: ``None``.
* ``embed`` (and the weights' other model dimensions ``embed_vocab``, ``embed_moe``,
  ``q_lora``, ``kv_lora``): MaxText also splits it over ``context`` and ``expert``;
  jaxpar over ``fsdp`` (its transformer adds ``seq`` where the width divides).
* ``activation_batch`` (and the other batches): MaxText's also name ``stage`` around
  the embedding and the logits; jaxpar's are ``BATCH_AXES``, ``expert`` among them as in
  MaxText (expert devices are data-parallel outside the MoE layers).

MaxText's experts (``exp``, ``activation_exp``) go to ``expert``, an axis ``make_mesh``
makes only with ``expert`` > 1 (``mesh.expert``): without it they are replicated, as in
MaxText without expert parallelism. ``from_maxtext(table)`` loads a MaxText ``logical_axis_rules`` table as it
is, MaxText's rule for every name.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

from jaxpar.placement.mesh import ALL_AXES

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

BATCH_AXES = ("data", "fsdp", "expert")

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # Parameters. FSDP/ZeRO-3 shards the model dimension of every large weight over
    # `fsdp`; Megatron tensor parallelism splits heads, MLP and vocabulary over `tensor`.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("layers", "pipe"),
    ("norm", None),
    ("positions", None),
    # Inputs: the batch is split over every data-parallel axis, the length over `seq`.
    ("batch", BATCH_AXES),
    ("length", "seq"),
    # Activations. `activation_norm_length` is the length of the residual stream between
    # tensor-parallel regions (norms, residual adds): Megatron sequence parallelism
    # splits it over `tensor` too (SEQUENCE_PARALLEL).
    ("activation_batch", BATCH_AXES),
    ("activation_length", "seq"),
    ("activation_norm_length", "seq"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # The rest of MaxText's base.yml, MaxText's meaning on jaxpar's axes (see the module
    # docstring and from_maxtext); variants of the names above follow their rules.
    #
    # Vocabulary: the embedding table's model dimension; the batch (and the flattened
    # batch x length) of the embedding lookup and the logits.
    ("embed_vocab", "fsdp"),
    ("activation_embed_and_logits_batch", BATCH_AXES),
    ("activation_embed_and_logits_batch_sequence", BATCH_AXES + ("seq",)),
    # Attention weights: query heads, GPT-3's fused q/k/v index, the k/v projections'
    # head dim; MLA's low ranks, split as `embed` where a weight reads them (`q_lora`,
    # `kv_lora`), whole where it writes them (`*_up_proj`).
    ("q_heads", "tensor"),
    ("qkv", None),
    ("kv_head_dim", None),
    ("q_lora", "fsdp"),
    ("q_lora_up_proj", None),
    ("kv_lora", "fsdp"),
    ("kv_lora_up_proj", None),
    # Attention activations: the keys/values' length stays whole (ring attention passes
    # the blocks round), the head dim is `activation_kv`'s.
    ("activation_batch_attn", BATCH_AXES),
    ("activation_kv_batch", BATCH_AXES),
    ("activation_input_length_attn", "seq"),
    ("activation_length_attn", "seq"),
    ("activation_q_length", "seq"),
    ("activation_kv_length", None),
    ("activation_embed_attn", None),
    ("activation_kv_head_dim", None),
    # Mixture of experts: the experts over `expert` (replicated on meshes without it),
    # each expert's weights as the dense MLP's.
    ("exp", "expert"),
    ("embed_moe", "fsdp"),
    ("mlp_moe", "tensor"),
    ("activation_exp", "expert"),
    ("activation_batch_moe", BATCH_AXES),
    ("activation_length_moe", "seq"),
    ("activation_norm_length_moe", "seq"),
    ("activation_embed_moe", None),
    ("activation_mlp_moe", "tensor"),
    # Other layers: gated-delta-net heads (Qwen3-Next's linear attention, split as
    # `mlp`), Engram's memory width, mHC's residual streams.
    ("gdn_head", "tensor"),
    ("engram_dim", "tensor"),
    ("mhc", None),
    # Layer stacks: activations' pipeline-stage dimension; the stacked-layer dimension of
    # layer groups (dense, MoE, a stage's own layers, circular repeats), whole on each
    # stage; DiLoCo's replicas, which jaxpar has not.
    ("activation_stage", "pipe"),
    ("dense_layers", None),
    ("moe_layers", None),
    ("local_layers", None),
    ("circular_repeats", None),
    ("diloco", None),
    # Inference: prefill and decode activations; the KV cache, its heads split as
    # `heads`, the rest whole; paged attention's pages.
    ("prefill_activation_length", "seq"),
    ("prefill_activation_norm_length", "seq"),
    ("activation_prefill_kv_batch", BATCH_AXES),
    ("decode_batch", BATCH_AXES),
    ("decode_length", None),
    ("cache_batch", None),
    ("cache_batch_prefill", None),
    ("cache_sequence", None),
    ("cache_heads", "tensor"),
    ("cache_heads_none", None),
    ("cache_kv", None),
    ("paged_kv_heads", "tensor"),
    ("paged_kv_head_dim_size", None),
    ("num_pages", None),
    ("tokens_per_page", None),
    # Deprecated in MaxText: MoE weights' MLP dimension without FSDP, experts over fsdp.
    ("mlp_no_fsdp", "tensor"),
    ("exp_with_fsdp", "fsdp"),
)


# Megatron sequence parallelism (Korthikanti et al. 2022): outside attention and the MLP
# the activations are split along length over the tensor group, so norms and residual
# adds are not computed redundantly and their activations take 1/tensor of the memory;
# the all-reduce after each row-parallel projection becomes a reduce-scatter, and an
# all-gather feeds the next column-parallel projection. Apply with ``override``.
SEQUENCE_PARALLEL: dict[str, MeshAxes] = {"activation_norm_length": ("seq", "tensor")}


# Expert parallelism for serving (vLLM's, without data-parallel attention): the batch
# whole on every `expert` device, so attention is computed (or tensor-split) as without
# the axis, and in a MoE layer each device runs its own experts over every row and the
# outputs are summed over `expert` (jaxpar.models.moe, "owned" experts). Apply with
# ``override``.
EXPERTS_OWNED: dict[str, MeshAxes] = {name: tuple(a for a in axes if a != "expert")
                                      for name, axes in DEFAULT_RULES if axes == BATCH_AXES}


# Optimus 2D tensor parallelism on a tensor_row x tensor_col grid: every weight matrix
# is blocked with its model dimension D over tensor_row (and fsdp) and its other
# dimension over tensor_col; every activation has its tokens (the batch) over
# tensor_row with the data-parallel axes and its features over tensor_col, so no
# device holds a replicated activation. Projections run as SUMMA (jaxpar.ops.linear.dense).
TENSOR_2D: dict[str, MeshAxes] = {
    "embed": ("fsdp", "tensor_row"),
    "vocab": "tensor_col",
    "heads": "tensor_col",
    "kv_heads": "tensor_col",
    "mlp": "tensor_col",
    "batch": ("data", "fsdp", "tensor_row"),
    "activation_batch": ("data", "fsdp", "tensor_row"),
    "activation_embed": "tensor_col",
    "activation_heads": "tensor_col",
    "activation_kv_heads": "tensor_col",
    "activation_mlp": "tensor_col",
    "activation_vocab": "tensor_col",
}


def override(rules: Rules, changes: dict[str, MeshAxes]) -> tuple[tuple[str, MeshAxes], ...]:
    """``rules`` with the logical names in ``changes`` mapped anew (``extend`` adds names).

    Raises:
      ValueError: ``changes`` names a logical axis that ``rules`` does not have, or maps
        one to something that is not mesh axes.
    """
    rules = freeze(rules)
    known = {name for name, _ in rules}
    for name in changes:
        if name not in known:
            raise ValueError(f"cannot override logical axis {name!r}{_suggest(name, sorted(known))}: "
                             f"no rule has it; add it with jaxpar.rules.extend(rules, ({name!r}, MESH_AXES))")
    return freeze(tuple((name, changes.get(name, axes)) for name, axes in rules))


def extend(rules: Rules, *new_rules: tuple[str, MeshAxes]) -> tuple[tuple[str, MeshAxes], ...]:
    """``rules`` with ``new_rules``, ``(logical_name, mesh_axes)`` pairs, added after them::

        rules = jaxpar.rules.extend(jaxpar.rules.DEFAULT_RULES, ("hidden", "tensor"), ("conv", None))

    (``override`` remaps names that have a rule.)

    Raises:
      ValueError: a pair is malformed, or names a logical axis that already has a rule.
    """
    rules = freeze(rules)
    known = {name for name, _ in rules}
    for entry in freeze(new_rules):
        if entry[0] in known:
            raise ValueError(f"logical axis {entry[0]!r} has a rule already ({entry[0]!r} -> "
                             f"{dict(rules)[entry[0]]!r}); change it with jaxpar.rules.override")
    return freeze(rules + tuple(new_rules))


def identity(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> tuple[tuple[str, str], ...]:
    """Rules naming each of ``mesh``'s axes as itself, ``(("data", "data"), ("fsdp",
    "fsdp"), ...)``: for models annotated with mesh axes rather than logical names, as
    models written for Explicit sharding are (``nnx.with_partitioning(init, ("fsdp",
    "tensor"))``). Alone, or added to logical rules::

        rules = jaxpar.rules.extend(jaxpar.rules.DEFAULT_RULES, *jaxpar.rules.identity(mesh))

    Names stay strict: an annotation naming an axis ``mesh`` lacks is still an error.
    """
    return freeze(tuple((axis, axis) for axis in mesh.axis_names))


# MaxText's mesh axes (base.yml's `mesh_axes`; `sequence` and `tensor_transpose` of older
# tables) -> jaxpar's, for from_maxtext; None: no counterpart, dropped from the rules.
MAXTEXT_MESH_AXES: dict[str, str | None] = {
    "data": "data",
    "fsdp": "fsdp",
    "stage": "pipe",
    "tensor": "tensor",
    # Context parallelism splits the sequence: `context` (ring attention), the Ulysses
    # half of MaxText's 2D USP (jaxpar's `seq` runs ring or Ulysses attention), and the
    # older tables' sequence-parallel axis.
    "context": "seq",
    "context_usp_ulysses": "seq",
    "sequence": "seq",
    # An axis of its own, not `fsdp`: MaxText splits a MoE weight's experts (`exp`) over
    # `expert` and its model dimension (`embed_moe`) over `fsdp`; on one axis the two
    # would collide on every MoE weight.
    "expert": "expert",
    # 2D FSDP's second axis, the weights' MLP dimension: on `fsdp` it would collide with
    # `embed` on each weight.
    "fsdp_transpose": None,
    # Megatron sequence parallelism on an axis of its own (heads, MLP and the norm-region
    # length): jaxpar does it on `tensor` (SEQUENCE_PARALLEL); mapped onto `tensor` it
    # would collide with MaxText's `activation_embed` in the residual stream.
    "tensor_sequence": None,
    # The older tables' second tensor axis (the weights' model dimension): jaxpar's 2D
    # grid is tensor_row x tensor_col, with rules of its own (TENSOR_2D).
    "tensor_transpose": None,
    # Decoding-only axes (the KV cache's heads; its length, batch, vocabulary), and
    # DiLoCo's replicas, which synchronise every few hundred steps, not each as `data`.
    "autoregressive": None,
    "context_autoregressive": None,
    "diloco": None,
}


def from_maxtext(table: Sequence[Sequence]) -> tuple[tuple[str, MeshAxes], ...]:
    """A jaxpar rule table from MaxText's ``logical_axis_rules``::

        import yaml
        table = yaml.safe_load(open("src/maxtext/configs/base.yml"))["logical_axis_rules"]
        rules = jaxpar.rules.for_mesh(mesh, jaxpar.rules.from_maxtext(table))

    ``table`` is a list of ``[logical_name, mesh_axes]``, ``mesh_axes`` a MaxText mesh
    axis, a list of them, or ``None``/``[]``. Mesh axes are mapped onto jaxpar's by
    ``MAXTEXT_MESH_AXES`` (``stage`` -> ``pipe``, ``context`` -> ``seq``, ``expert`` ->
    ``expert``; ``fsdp_transpose``, ``tensor_sequence``, ``autoregressive``... dropped),
    duplicates removed, order kept.

    MaxText resolves its table with flax's ``logical_to_mesh_axes``, which does not look
    at the mesh: for each array the rules are tried in order, and a rule is skipped only
    when its mesh axes are taken by another dimension of the same array; MaxText then
    removes the mesh axes of size 1. So the mesh never picks among a name's rules and no
    mesh is needed here (``for_mesh`` drops the axes a mesh lacks). A name keeps its
    first rule: flax reaches a later one only when another dimension holds the first
    one's axes, a case jaxpar reports instead (two dimensions of one array on one axis),
    so whenever jaxpar gives a spec, it is flax's. base.yml's fallbacks (``embed``,
    ``embed_moe``, ``q_lora``, ``kv_lora``, for when ``mlp`` holds ``fsdp_transpose``)
    differ from the first rules only by that axis, dropped here. Where MaxText leaves two
    names of one array on one axis to rule order (``activation_heads`` before
    ``activation_kv`` in attention's ``[B, T, N, H]``), jaxpar raises its error naming
    both: ``override`` the later one (``DEFAULT_RULES`` maps it to ``None``).

    Raises:
      ValueError: an entry is not a ``[name, mesh_axes]`` pair, or names a mesh axis
        that MaxText's meshes do not have.
    """
    first: dict[str, MeshAxes] = {}
    for entry in table:
        if isinstance(entry, str) or not (isinstance(entry, Sequence) and len(entry) == 2
                                          and isinstance(entry[0], str)):
            raise ValueError(f"a MaxText rule must be a [logical_name, mesh_axes] pair, got {entry!r}")
        name, axes = entry
        if not (axes is None or isinstance(axes, str) or isinstance(axes, Sequence)):
            raise ValueError(f"MaxText rule {name!r}: mesh axes must be a name, a list of names or None, got {axes!r}")
        mapped = []
        for axis in as_tuple(axes):
            if not isinstance(axis, str) or axis not in MAXTEXT_MESH_AXES:
                raise ValueError(
                    f"MaxText rule {name!r} names mesh axis {axis!r}, which MaxText's meshes do not have"
                    f"{_suggest(str(axis), list(MAXTEXT_MESH_AXES))}; they are {list(MAXTEXT_MESH_AXES)}")
            if MAXTEXT_MESH_AXES[axis] is not None and MAXTEXT_MESH_AXES[axis] not in mapped:
                mapped.append(MAXTEXT_MESH_AXES[axis])
        first.setdefault(name, None if not mapped else mapped[0] if len(mapped) == 1 else tuple(mapped))
    return freeze(tuple(first.items()))


def as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple: ``None`` -> ``()``, ``"fsdp"`` -> ``("fsdp",)``."""
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def _suggest(name: str, choices: Sequence[str]) -> str:
    """A " (did you mean 'x'?)" hint naming a real near-miss of ``name`` among
    ``choices`` (a typo or letters swapped: ``fdsp`` -> ``fsdp``, ``mpl`` -> ``mlp``),
    else ``""`` (``tensor`` is not a near-miss of ``norm``)."""
    swapped = [c for c in choices if len(c) > 2 and sorted(c) == sorted(name)]
    close = swapped or difflib.get_close_matches(name, choices, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def freeze(rules: Rules) -> tuple[tuple[str, MeshAxes], ...]:
    """Validates the table's shape and returns it as a hashable tuple."""
    if isinstance(rules, tuple):
        try:
            return _freeze_tuple(rules)  # the planner freezes the same tables thousands of times
        except TypeError:  # unhashable (a list inside)
            pass
    return _freeze(rules)


@functools.lru_cache(maxsize=1024)
def _freeze_tuple(rules: tuple) -> tuple[tuple[str, MeshAxes], ...]:
    return _freeze(rules)


def _freeze(rules: Rules) -> tuple[tuple[str, MeshAxes], ...]:
    frozen = []
    seen = set()
    for entry in rules:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"a sharding rule must be a (logical_name, mesh_axes) pair, got {entry!r}")
        name, mesh_axes = entry
        if name in seen:
            raise ValueError(f"logical axis {name!r} has more than one sharding rule")
        seen.add(name)
        if mesh_axes is not None and not isinstance(mesh_axes, str):
            mesh_axes = tuple(mesh_axes)
            if not all(isinstance(a, str) for a in mesh_axes):
                raise ValueError(f"rule {name!r}: mesh axes must be names, got {mesh_axes!r}")
        frozen.append((name, mesh_axes))
    return tuple(frozen)


def for_mesh(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, rules: Rules = DEFAULT_RULES):
    """Returns ``rules`` restricted to the axes that ``mesh`` really has.

    Mesh axes that jaxpar knows but ``mesh`` lacks are dropped (a dimension mapped only to
    them becomes replicated), so the default table works on a user's own ``("data",)``
    mesh. A mesh axis that is neither a jaxpar axis nor one of ``mesh``'s is an error.

    Returns:
      A tuple of ``(logical_name, mesh_axes)`` pairs, usable with
      ``flax.linen.logical_axis_rules`` and ``jaxpar.shard_model``.
    """
    return _for_axes(tuple(mesh.axis_names), freeze(rules))


@functools.lru_cache(maxsize=256)
def _for_axes(axis_names: tuple[str, ...], rules: tuple[tuple[str, MeshAxes], ...]):
    known = tuple(dict.fromkeys(ALL_AXES + axis_names))
    restricted = []
    for name, mesh_axes in rules:
        kept = []
        for axis in as_tuple(mesh_axes):
            if axis not in known:
                raise ValueError(
                    f"sharding rule {name!r} names mesh axis {axis!r}, which no mesh has"
                    f"{_suggest(axis, known)}; mesh axes are {list(known)}"
                )
            if axis in axis_names:
                kept.append(axis)
        restricted.append((name, None if not kept else kept[0] if len(kept) == 1 else tuple(kept)))
    return tuple(restricted)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Maps one array's logical dimension names to a ``PartitionSpec`` over mesh axes.

    ``None`` in ``logical_axes`` leaves that dimension unsharded.

    Raises:
      ValueError: a name has no rule, or two dimensions map to the same mesh axis.
    """
    return _logical_to_spec(tuple(logical_axes), freeze(rules))


@functools.lru_cache(maxsize=4096)
def _logical_to_spec(logical_axes, rules) -> PartitionSpec:
    table = dict(rules)
    owner: dict[str, str] = {}
    spec = []
    for name in logical_axes:
        if name is None:
            spec.append(None)
            continue
        if name not in table and name in ALL_AXES:
            raise ValueError(
                f"{name!r} in {tuple(logical_axes)} is a mesh axis, not a logical axis name; "
                f"annotate with logical names, or map it: jaxpar.rules.extend(rules, ({name!r}, {name!r})), "
                "or every mesh axis to itself: jaxpar.rules.extend(rules, *jaxpar.rules.identity(mesh))"
            )
        if name not in table:
            raise ValueError(
                f"logical axis {name!r} has no sharding rule{_suggest(name, list(table))}; "
                f"known: {sorted(table)}. Add a rule for it: jaxpar.rules.extend(rules, "
                f"({name!r}, MESH_AXES)), or ({name!r}, None) to replicate it"
            )
        mesh_axes = table[name]
        for axis in as_tuple(mesh_axes):
            if axis in owner:
                raise ValueError(
                    f"logical axes {owner[axis]!r} and {name!r} of one array "
                    f"{tuple(logical_axes)} both map to mesh axis {axis!r}"
                )
            owner[axis] = name
        spec.append(mesh_axes)
    return PartitionSpec(*spec)


def explain(model_or_variables, mesh: jax.sharding.Mesh, rules: Rules | None = None):
    """Prints and returns where ``rules`` (default ``DEFAULT_RULES``) put each parameter
    of an NNX model / ``nnx.State`` or of Linen variables on ``mesh``: its logical
    names, mesh axes, shape and bytes per device, then the total bytes, the bytes per
    device and the share of parameter bytes every device holds whole. A
    ``jaxpar.placement.report.RuleReport``; see ``jaxpar.placement.report.explain``."""
    from jaxpar.placement import report  # report places models, which needs this module

    return report.explain(model_or_variables, mesh, rules)
