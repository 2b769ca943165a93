"""The ``correctness`` part (100 s): jaxpar's Pallas kernels against their references.

Each kernel compiled (``interpret=False``; Pallas interpret mode in ``--smoke``), forward
and backward, against its ``*_reference`` function on random inputs (``correctness_cases``):
flash attention (causal or not, GQA, packed documents, a sliding window, ``T < S``, head
dims 64/80/96/128, bf16/fp16/fp32), decode attention (token trees, head dim 80, a cache
poisoned past the lengths), paged decode attention (NaN in the slots no sequence owns),
ragged paged attention (one flat batch mixing decode tokens, a prompt chunk over a cached
prefix, a one-token prompt, a sequence's tokens not contiguous, padding; NaN in the slots
no token may read), RMSNorm and LayerNorm (widths 576, 768, 2048, 4096), linear + cross-entropy (V not a
multiple of the chunk), the MoE grouped matmul (skewed groups, empty ones, rows past the
groups' total; GPU cases only: its interpret-mode check is tests/test_kernels_grouped_matmul.py). Error: max |got - want| / max |want| (the tests'); within 2e-2
for bf16/fp16 (the tests' tolerance), 1e-4 for fp32 at ``highest`` matmul precision,
1e-2 for fp32 at the default (TF32 on a GPU). A case not started by the part's deadline
is ``skipped: time limit`` and fails the part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
import time
import traceback

from part import Record, short, time_left
from probe import need_pallas_gpu


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64 (tests/conftest.py's)."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    den = float(np.max(np.abs(want)))
    num = float(np.max(np.abs(got - want)))
    if not math.isfinite(num):
        return math.inf
    return num / den if den else num


def tolerance(dtype: str, precision: str) -> float:
    if dtype in ("bfloat16", "float16"):
        return 2e-2  # the tests' half-precision tolerance
    return 1e-4 if precision == "highest" else 1e-2  # TF32 at the default precision on a GPU


def matmul_precision(precision: str):
    """``highest``: JAX's highest matmul precision in this scope; else the default."""
    import jax

    return jax.default_matmul_precision("highest") if precision == "highest" else contextlib.nullcontext()


def _fwd_bwd(fn, args, cotangent):
    import jax

    def run(args, g):
        out, pull = jax.vjp(fn, *args)
        return out, pull(g)

    return jax.block_until_ready(jax.jit(run)(args, cotangent))


def _normal(rng, shape, dtype, scale=1.0):
    import jax.numpy as jnp

    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def check_flash(interpret, *, B, T, S, N, K, H, causal, window=None, packed=False, dtype="bfloat16",
                precision="highest", seed=0) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels import flash_attention, flash_attention_reference

    rng = np.random.default_rng(seed)
    q, g = _normal(rng, (B, T, N, H), dtype), _normal(rng, (B, T, N, H), dtype)
    k, v = _normal(rng, (B, S, K, H), dtype), _normal(rng, (B, S, K, H), dtype)
    seg = None
    if packed:  # two or three documents per row
        cuts = np.sort(rng.choice(np.arange(1, T), size=(B, 2), replace=True), axis=1)
        seg = jnp.asarray((np.arange(T)[None] >= cuts[:, :1]).astype(np.int32)
                          + (np.arange(T)[None] >= cuts[:, 1:]).astype(np.int32))
    options = dict(causal=causal, segment_ids=seg, window=window)
    with matmul_precision(precision):
        got = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, **options, interpret=interpret), (q, k, v), g)
        want = _fwd_bwd(lambda q, k, v: flash_attention_reference(q, k, v, **options), (q, k, v), g)
    (o, (dq, dk, dv)), (ro, (rq, rk, rv)) = got, want
    return {"out": rel_err(o, ro), "dq": rel_err(dq, rq), "dk": rel_err(dk, rk), "dv": rel_err(dv, rv)}


def random_trees(rng, B, T):
    """``[B, T, T]`` ancestors-or-self masks of random token trees (tests'), not all chains."""
    import numpy as np

    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, T)]
        if b == 0 and T > 2:
            parent[1] = parent[2] = 0
        for t in range(T):
            a = t
            while a >= 0:
                mask[b, t, a], a = True, parent[a]
    return mask


def check_decode(interpret, *, B, T, N, K, H, S, tree=False, dtype="bfloat16", precision="highest", seed=0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels import decode_attention, decode_attention_reference

    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[T, S], rng.integers(T + 1, S, size=max(B - 2, 0))])[:B]
    q = rng.standard_normal((B, T, N, H))
    k, v = rng.standard_normal((2, B, S, K, H))
    for b, length in enumerate(lengths):  # past each length: values no query may see
        k[b, length:] = rng.uniform(-1e4, 1e4, k[b, length:].shape)
        v[b, length:] = rng.uniform(-1e4, 1e4, v[b, length:].shape)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    lengths = jnp.asarray(lengths, jnp.int32)
    tree_mask = jnp.asarray(random_trees(rng, B, T)) if tree else None
    with matmul_precision(precision):
        got = jax.jit(lambda *a: decode_attention(*a, tree_mask=tree_mask, interpret=interpret))(q, k, v, lengths)
        want = jax.jit(lambda *a: decode_attention_reference(*a, tree_mask=tree_mask))(q, k, v, lengths)
    return {"out": rel_err(got, want)}


def check_paged(interpret, *, B, T, N, K, H, page_size, max_pages, dtype="bfloat16", precision="highest",
                seed=0) -> dict:
    """Two layers of pages, layer 1 read; every slot no sequence owns holds NaN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels import paged_decode_attention, paged_decode_attention_reference

    rng = np.random.default_rng(seed)
    cap = max_pages * page_size
    lengths = [T, min(2 * page_size, cap), cap - 1][:B] + [int(x) for x in rng.integers(T, cap, size=max(B - 3, 0))]
    used = [-(-length // page_size) for length in lengths]
    P = 1 + sum(used) + 2
    k, v = np.full((2, 2, P, page_size, K, H), np.nan)
    ids = 1 + rng.permutation(P - 1)
    tables = np.zeros((B, max_pages), np.int32)
    for b, (length, count) in enumerate(zip(lengths, used)):
        tables[b, :count], ids = ids[:count], ids[count:]
        for s in range(length):
            page, at = tables[b, s // page_size], s % page_size
            k[1, page, at], v[1, page, at] = rng.standard_normal((2, K, H))
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    tables, lengths = jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)
    layer = jnp.int32(1)
    with matmul_precision(precision):
        got = jax.jit(lambda *a: paged_decode_attention(*a, interpret=interpret))(q, k, v, layer, tables, lengths)
        want = jax.jit(paged_decode_attention_reference)(q, k, v, layer, tables, lengths)
    return {"out": rel_err(got, want)}


def check_ragged(interpret, *, N, K, H, page_size, width, decode, chunk, dtype="bfloat16", precision="highest",
                 seed=0) -> dict:
    """One flat token batch over two layers of pages, layer 1 read: ``decode`` decode
    tokens over random contexts (the last in its table's final slot), a prompt chunk of
    ``chunk`` tokens over a cached prefix, a one-token prompt, a sequence's three tokens
    scattered through the batch, padding; every slot no token may read holds NaN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels import ragged_paged_attention, ragged_paged_attention_reference

    rng = np.random.default_rng(seed)
    cap = width * page_size
    contexts = [int(x) for x in rng.integers(1, cap, size=decode - 1)] + [cap]
    prefix = int(rng.integers(1, cap - chunk))
    tokens = [(i, n - 1) for i, n in enumerate(contexts)]  # decode: sequence i at its last slot
    chunk_seq, prompt_seq, scattered_seq = decode, decode + 1, decode + 2
    tokens += [(chunk_seq, prefix + j) for j in range(chunk)] + [(prompt_seq, 0)]
    for j, at in enumerate(sorted(rng.choice(len(tokens), size=3, replace=False))[::-1]):
        tokens.insert(int(at), (scattered_seq, 6 - j))  # positions 4, 5, 6, apart
    for at in rng.choice(len(tokens), size=4, replace=False):
        tokens.insert(int(at), (-1, 0))
    S = decode + 4  # a table row no token reads
    last = [max((p for s, p in tokens if s == i), default=-1) for i in range(S)]
    used = [-(-(n + 1) // page_size) for n in last]
    P = 1 + sum(used) + 2
    shape = (2, P, page_size, K, H)
    k, v = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    ids = 1 + rng.permutation(P - 1)
    tables = np.zeros((S, width), np.int32)
    for i, count in enumerate(used):
        tables[i, :count], ids = ids[:count], ids[count:]
        slots = np.arange(last[i] + 1)
        page, at = tables[i, slots // page_size], slots % page_size
        k[1, page, at], v[1, page, at] = rng.standard_normal((2, len(slots), K, H), np.float32)
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    positions = jnp.asarray([p for _, p in tokens], jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(tokens), N, H)), dtype)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    tables, layer = jnp.asarray(tables), jnp.int32(1)
    with matmul_precision(precision):
        got = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=interpret))(q, k, v, layer, seq, positions,
                                                                                 tables)
        want = jax.jit(ragged_paged_attention_reference)(q, k, v, layer, seq, positions, tables)
    return {"out": rel_err(got, want)}


def check_norm(interpret, *, shape, kind, dtype="bfloat16", precision="highest", seed=0) -> dict:
    import numpy as np

    from jaxpar.kernels import norm, norm_reference

    rng = np.random.default_rng(seed)
    D = shape[-1]
    x, g = _normal(rng, shape, dtype, 2.0), _normal(rng, shape, dtype)
    scale = _normal(rng, (D,), "float32", 0.1) + 1.0
    args = (x, scale) + ((_normal(rng, (D,), "float32", 0.1),) if kind == "layer" else ())
    with matmul_precision(precision):
        got = _fwd_bwd(lambda *a: norm(*a, kind=kind, interpret=interpret), args, g)
        want = _fwd_bwd(lambda *a: norm_reference(*a, kind=kind), args, g)
    names = ("dx", "dscale", "dbias")
    errs = {"out": rel_err(got[0], want[0])}
    errs.update({names[i]: rel_err(a, b) for i, (a, b) in enumerate(zip(got[1], want[1]))})
    return errs


def check_ce(interpret, *, N, D, V, dtype="bfloat16", precision="highest", seed=0) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels import linear_cross_entropy, linear_cross_entropy_reference

    rng = np.random.default_rng(seed)
    x, w = _normal(rng, (N, D), dtype), _normal(rng, (D, V), dtype, D ** -0.5 * 3)
    targets = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    g = _normal(rng, (N,), "float32")
    with matmul_precision(precision):
        got = _fwd_bwd(lambda x, w: linear_cross_entropy(x, w, targets, interpret=interpret), (x, w), g)
        want = _fwd_bwd(lambda x, w: linear_cross_entropy_reference(x, w, targets), (x, w), g)
    return {"loss": rel_err(got[0], want[0]), "dx": rel_err(got[1][0], want[1][0]),
            "dw": rel_err(got[1][1], want[1][1])}


def check_gmm(interpret, *, M, K, N, G, past=0, dtype="bfloat16", precision="highest", seed=0) -> dict:
    """``grouped_matmul`` forward and both gradients: skewed group sizes (Dirichlet(0.5)
    shares), group 1 empty, the last ``past`` rows past the groups' total."""
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels import grouped_matmul, grouped_matmul_reference

    rng = np.random.default_rng(seed)
    share = rng.dirichlet(np.full(G, 0.5))
    share[1 % G] = 0.0
    sizes = np.floor(share / share.sum() * (M - past)).astype(np.int32)
    sizes[0] += M - past - sizes.sum()
    x, w, g = _normal(rng, (M, K), dtype), _normal(rng, (G, K, N), dtype, K ** -0.5), _normal(rng, (M, N), dtype)
    sizes = jnp.asarray(sizes)
    with matmul_precision(precision):
        got = _fwd_bwd(lambda x, w: grouped_matmul(x, w, sizes, interpret=interpret), (x, w), g)
        want = _fwd_bwd(lambda x, w: grouped_matmul_reference(x, w, sizes), (x, w), g)
    (o, (dx, dw)), (ro, (rx, rw)) = got, want
    return {"out": rel_err(o, ro), "dlhs": rel_err(dx, rx), "drhs": rel_err(dw, rw)}


@dataclasses.dataclass
class Case:
    kernel: str
    name: str
    check: functools.partial

    @property
    def dtype(self) -> str:
        return self.check.keywords.get("dtype", "bfloat16")

    @property
    def precision(self) -> str:
        return self.check.keywords.get("precision", "highest")


def correctness_cases(smoke: bool) -> list[Case]:
    P = functools.partial
    if smoke:  # tiny: Pallas interpret mode compiles slowly on a CPU
        return [
            Case("flash_attention", "B1 T40 N4 K2 H80 causal packed f32",
                 P(check_flash, B=1, T=40, S=40, N=4, K=2, H=80, causal=True, packed=True, dtype="float32")),
            Case("flash_attention", "B1 T24 S40 N2 K2 H64 causal window 8 bf16",
                 P(check_flash, B=1, T=24, S=40, N=2, K=2, H=64, causal=True, window=8)),
            Case("decode_attention", "B3 T4 N4 K2 H80 S50 tree f32",
                 P(check_decode, B=3, T=4, N=4, K=2, H=80, S=50, tree=True, dtype="float32")),
            Case("paged_decode_attention", "B3 T2 N4 K2 H64 pages of 8 bf16",
                 P(check_paged, B=3, T=2, N=4, K=2, H=64, page_size=8, max_pages=4)),
            Case("ragged_paged_attention", "T13: 4 decode + a 9-token chunk, N4 K2 H64 pages of 8 f32",
                 P(check_ragged, N=4, K=2, H=64, page_size=8, width=4, decode=4, chunk=9, dtype="float32")),
            Case("norm", "layer [37, 96] f32", P(check_norm, shape=(37, 96), kind="layer", dtype="float32")),
            Case("linear_cross_entropy", "N40 D96 V300 bf16", P(check_ce, N=40, D=96, V=300)),
        ]
    return [
        Case("flash_attention", "B2 T512 N8 K8 H128 causal bf16",
             P(check_flash, B=2, T=512, S=512, N=8, K=8, H=128, causal=True)),
        Case("flash_attention", "B2 T512 N8 K8 H128 not causal bf16",
             P(check_flash, B=2, T=512, S=512, N=8, K=8, H=128, causal=False)),
        Case("flash_attention", "B2 T300 N8 K2 H64 causal packed bf16 (GQA, ragged T)",
             P(check_flash, B=2, T=300, S=300, N=8, K=2, H=64, causal=True, packed=True)),
        Case("flash_attention", "B1 T256 N4 K4 H80 causal bf16",
             P(check_flash, B=1, T=256, S=256, N=4, K=4, H=80, causal=True)),
        Case("flash_attention", "B1 T200 N8 K4 H96 not causal fp16",
             P(check_flash, B=1, T=200, S=200, N=8, K=4, H=96, causal=False, dtype="float16")),
        Case("flash_attention", "B1 T64 S320 N4 K4 H64 causal bf16 (T < S, bottom-right)",
             P(check_flash, B=1, T=64, S=320, N=4, K=4, H=64, causal=True)),
        Case("flash_attention", "B2 T256 N4 K2 H64 causal window 64 f32 highest",
             P(check_flash, B=2, T=256, S=256, N=4, K=2, H=64, causal=True, window=64, dtype="float32")),
        Case("flash_attention", "B2 T384 N8 K2 H128 causal packed f32 highest",
             P(check_flash, B=2, T=384, S=384, N=8, K=2, H=128, causal=True, packed=True, dtype="float32")),
        Case("flash_attention", "B2 T256 N4 K2 H64 causal f32 default precision (TF32)",
             P(check_flash, B=2, T=256, S=256, N=4, K=2, H=64, causal=True, dtype="float32", precision="default")),
        Case("decode_attention", "B4 T1 N32 K8 H128 S2048 bf16",
             P(check_decode, B=4, T=1, N=32, K=8, H=128, S=2048)),
        Case("decode_attention", "B3 T5 N8 K2 H80 S700 tree f32 highest",
             P(check_decode, B=3, T=5, N=8, K=2, H=80, S=700, tree=True, dtype="float32")),
        Case("decode_attention", "B2 T4 N16 K2 H64 S1000 causal bf16",
             P(check_decode, B=2, T=4, N=16, K=2, H=64, S=1000)),
        Case("paged_decode_attention", "B3 T1 N8 K2 H128 pages of 16 bf16",
             P(check_paged, B=3, T=1, N=8, K=2, H=128, page_size=16, max_pages=40)),
        Case("paged_decode_attention", "B3 T5 N4 K4 H80 pages of 6 f32 highest",
             P(check_paged, B=3, T=5, N=4, K=4, H=80, page_size=6, max_pages=20, dtype="float32")),
        Case("ragged_paged_attention", "T232: 32 decode + a 192-token chunk, N32 K8 H128 pages of 16 bf16",
             P(check_ragged, N=32, K=8, H=128, page_size=16, width=32, decode=32, chunk=192)),
        Case("ragged_paged_attention", "T74: 16 decode + a 50-token chunk, N8 K2 H80 pages of 6 f32 highest",
             P(check_ragged, N=8, K=2, H=80, page_size=6, width=40, decode=16, chunk=50, dtype="float32")),
        Case("norm", "rms [4096, 4096] bf16", P(check_norm, shape=(4096, 4096), kind="rms")),
        Case("norm", "layer [37, 576] f32 highest", P(check_norm, shape=(37, 576), kind="layer", dtype="float32")),
        Case("norm", "rms [3, 5, 768] f32 highest", P(check_norm, shape=(3, 5, 768), kind="rms", dtype="float32")),
        Case("norm", "layer [1000, 2048] bf16", P(check_norm, shape=(1000, 2048), kind="layer")),
        Case("linear_cross_entropy", "N1000 D576 V5000 bf16", P(check_ce, N=1000, D=576, V=5000)),
        Case("linear_cross_entropy", "N100 D256 V1000 f32 highest", P(check_ce, N=100, D=256, V=1000, dtype="float32")),
        Case("grouped_matmul", "M1000 K512 N768 G8 bf16 (skewed, one group empty, 24 rows past the total)",
             P(check_gmm, M=1000, K=512, N=768, G=8, past=24)),
        Case("grouped_matmul", "M2048 K512 N256 G64 bf16 (many experts, skewed: some nearly empty)",
             P(check_gmm, M=2048, K=512, N=256, G=64)),
        Case("grouped_matmul", "M300 K200 N136 G5 f32 highest", P(check_gmm, M=300, K=200, N=136, G=5, past=7,
                                                                    dtype="float32")),
    ]


def part_correctness(ns, rec: Record) -> None:
    interpret = not need_pallas_gpu(ns)
    import jaxpar.kernels

    rec["kernels_from"] = str(pathlib.Path(jaxpar.kernels.__file__).resolve().parent)
    rec["interpret"] = interpret
    rec["cases"] = []
    for case in correctness_cases(ns.smoke):
        tol = tolerance(case.dtype, case.precision)
        row = {"kernel": case.kernel, "case": case.name, "dtype": case.dtype, "precision": case.precision,
               "tolerance": tol}
        if time_left() < 3:
            row["status"] = "skipped: time limit"
        else:
            began = time.perf_counter()
            try:
                row["errors"] = case.check(interpret)
                worst = max(row["errors"].values())
                row["worst"] = worst
                row["status"] = "ok" if worst <= tol else "failed: error above tolerance"
            except Exception as e:  # noqa: BLE001 - a compile or run failure is a result
                row["status"] = f"failed: {short(e)}"
                row["trace"] = traceback.format_exc()[-2500:]
                print(row["trace"], flush=True)
            row["seconds"] = round(time.perf_counter() - began, 2)
        print(f"  {case.kernel}: {case.name}: {row['status']}"
              + (f" (worst {row['worst']:.1e}, tolerance {tol:.0e})" if "worst" in row else ""), flush=True)
        rec["cases"].append(row)
        rec.save()
    cases = rec["cases"]
    ok = [c for c in cases if c["status"] == "ok"]
    bad = [c for c in cases if c["status"].startswith("failed")]
    skipped = [c for c in cases if c["status"].startswith("skipped")]
    rec["status"] = "ok" if len(ok) == len(cases) else "failed"
    margin = max((c["worst"] / c["tolerance"] for c in ok), default=0.0)
    rec["summary"] = (f"{len(ok)}/{len(cases)} kernel cases within tolerance, forward and backward"
                      f"{' (interpret mode)' if interpret else ', compiled'}; worst error {margin:.2f}x its tolerance"
                      + (f"; {len(bad)} failed" if bad else "") + (f"; {len(skipped)} not reached" if skipped else ""))
    if rec["status"] == "failed":
        rec["reason"] = "; ".join(
            ([f"{len(bad)} failed: " + ", ".join(f"{c['kernel']} {c['case']}" for c in bad)] if bad else [])
            + ([f"{len(skipped)} not reached (time limit)"] if skipped else []))
    rec["details"] = [f"  {c['kernel']}: {c['case']}: {c['status']}"
                      + (f", worst {c['worst']:.1e} (tolerance {c['tolerance']:.0e})" if "worst" in c else "")
                      for c in cases]

