"""Which training features compose: each feature declared once, each pair that does not
compose yet refused once, with its reason.

``Config`` checks a config against the table when it is read (``check``: one line naming
both keys; the CLI exits 2 before any data is read or program compiled, nothing
written), and ``make_train_step`` checks its own arguments against the same table
(``refusal``), so a caller of the Python API meets the same line. The README's table of
combinations is ``markdown()``'s output (``tests/test_combinations.py`` holds them
equal).

A feature is named by the config key that turns it on, as a line names it. Pairs not in
``REFUSED`` compose.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable



@dataclasses.dataclass(frozen=True)
class Feature:
    """``key``: the config key (and value) that turns the feature on, as the table names
    it; ``on``: whether a config (``jaxpar.train.config.Config``) turns it on; ``shown``:
    the setting as a refusal's line names it (default ``key``)."""

    key: str
    on: Callable
    shown: Callable | None = None

    def show(self, cfg) -> str:
        return self.key if self.shown is None else self.shown(cfg)


def _reduction(cfg):
    return cfg.gradient_reduction


def _listed(weights) -> str:
    return str(list(weights)) if isinstance(weights, tuple) else repr(weights)


def _mesh(axis: str) -> Feature:
    return Feature(f"mesh.{axis}", lambda c: getattr(c.layout, axis) != 1,
                   lambda c: f"mesh.{axis}={getattr(c.layout, axis)}")


# The features a run turns on by config, then the mesh's axes (so a line reads
# "offload.optimizer='host' with mesh.pipe=2").
FEATURES = (
    Feature("model.moe", lambda c: getattr(c.model, "moe", None) is not None),
    Feature("offload", lambda c: bool(c.offload_requested), lambda c: c.offload_requested[0]),
    Feature("data.batch_weights", lambda c: c.data.batch_weights is not None,
            lambda c: f"data.batch_weights={_listed(c.data.batch_weights)}"),
    Feature("optimizer.reduction=adasum", lambda c: _reduction(c).kind == "adasum"),
    Feature("optimizer.compression=dct_topk", lambda c: _reduction(c).compressed),
    Feature("eval.noise_scale", lambda c: c.eval.noise_scale),
    Feature("task=glide", lambda c: c.task == "glide"),
    Feature("optimizer.grad_accum", lambda c: c.layout.grad_accum > 1,
            lambda c: f"optimizer.grad_accum={c.layout.grad_accum}"),
    _mesh("fsdp"), _mesh("tensor"), _mesh("pipe"), _mesh("seq"),
)
KEYS = tuple(f.key for f in FEATURES)
MESH_KEYS = ("mesh.fsdp", "mesh.tensor", "mesh.pipe", "mesh.seq")

_ROWS_LOOP = ("each data replica runs its own count of microbatches (a loop of its own length), and this "
              "axis's collective-permutes meet every device at once (FSDP's and tensor's collectives stay "
              "within a replica)")
_NOISE_MEAN = "the noise scale's large batch is the plain mean's gradient, which {} replaces"
REFUSED: dict[frozenset, str] = {frozenset(pair): why for pair, why in {
    ("model.moe", "task=glide"): "a GliDe draft reads a dense target's layers",
    ("data.batch_weights", "mesh.pipe"): _ROWS_LOOP,
    ("data.batch_weights", "mesh.seq"): _ROWS_LOOP,
    ("data.batch_weights", "task=glide"): "unequal rows are built for a language model's batch (task=lm)",
    ("eval.noise_scale", "optimizer.reduction=adasum"): _NOISE_MEAN.format("Adasum"),
    ("eval.noise_scale", "optimizer.compression=dct_topk"): _NOISE_MEAN.format("the top-k exchange"),
    ("mesh.pipe", "task=glide"): "a pipelined step computes the next-token loss itself; the draft's loss is not "
                                 "staged",
}.items()}
assert all(len(pair) == 2 and pair <= set(KEYS) for pair in REFUSED), "REFUSED names a feature not in FEATURES"


def on(cfg) -> dict[str, str]:
    """The features ``cfg`` turns on, in ``FEATURES``' order, each key to its setting as
    shown (the mesh's only once it is known: not with ``mesh=auto``)."""
    auto = cfg.mesh == "auto"
    return {f.key: f.show(cfg) for f in FEATURES if not (auto and f.key in MESH_KEYS) and f.on(cfg)}


def refusal(present: dict[str, str]) -> str | None:
    """The line refusing the first pair of ``present`` features (key to setting shown, in
    ``FEATURES``' order) that does not compose, or None."""
    for a, b in itertools.combinations(present, 2):
        why = REFUSED.get(frozenset((a, b)))
        if why is not None:
            return f"{present[a]} with {present[b]} is not supported yet: {why}"
    return None


def check(cfg) -> None:
    """Raises ``ValueError`` with ``refusal``'s line where ``cfg`` turns on two features
    that do not compose."""
    line = refusal(on(cfg))
    if line is not None:
        raise ValueError(line)


def markdown() -> str:
    """The README's table: a row and a column per feature, each cell "works" or "no" with
    the reason's number, the reasons listed below the table."""
    reasons = list(dict.fromkeys(REFUSED.values()))
    short = [k.replace("optimizer.", "").replace("mesh.", "") for k in KEYS]
    lines = ["| | " + " | ".join(short) + " |", "|---" * (len(KEYS) + 1) + "|"]
    for a in KEYS:
        cells = ["" if a == b else (f"no ({reasons.index(REFUSED[frozenset((a, b))]) + 1})"
                                    if frozenset((a, b)) in REFUSED else "works") for b in KEYS]
        lines.append(f"| `{a}` | " + " | ".join(cells) + " |")
    lines += ["", *(f"{i}. {why}." for i, why in enumerate(reasons, 1))]
    return "\n".join(lines)
