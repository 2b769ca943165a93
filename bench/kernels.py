"""jaxpar's Pallas kernels beside cuDNN, plain XLA and JAX's own Pallas ops, timed on one GPU.

GPU, one call (H100 or H200):

    python bench/kernels.py --json $OUT/kernels.json

CPU correctness smoke, not a performance figure (tiny shapes; jaxpar's kernels and JAX's
Triton ones in Pallas interpret mode; cuDNN and Mosaic GPU cells say "needs GPU"; the
`tiny` training step with ``execution.attention=xla``):

    python bench/kernels.py --smoke

What one call measures (``--parts`` picks a subset; tables print as each part ends, the
targets table last; ``--json`` gets every figure and error):

* ``ceilings``, in the same run: bf16 peak of an 8192^3 ``jnp.dot`` (TFLOP/s), and copy
  bandwidth over 1 GiB of bf16, bytes read + written, the faster of ``jnp.copy`` (a
  device-to-device memcpy) and ``y = -x`` (a streaming kernel).
* ``norms``: ``jaxpar.kernels.norm`` (rms and layer) on ``[16384, 4096]`` bf16 (float32
  scale/bias), forward and forward + backward, beside ``norm_reference`` jitted (XLA).
  Bytes: forward reads x and writes y (2 x 2 bytes per element); forward + backward also
  reads x and dy and writes dx (5 x 2 bytes per element).
* ``ce``: ``jaxpar.kernels.linear_cross_entropy`` with N=8192, D=2048, V=128256 bf16,
  forward and forward + backward, beside ``linear_cross_entropy_reference`` (XLA, float32
  logits). FLOPs: forward 2NDV; forward + backward 3x that (the dx and dw matmuls; the
  kernel's recomputed logits are not counted). Bytes: x and w read once per pass (forward +
  backward: 3x the forward's). The arithmetic intensity at this shape (~7,700 FLOP/byte)
  is far above the ridge (~200), so the matmul bound applies, not copy bandwidth: both
  are printed, and the target is judged as the roofline floor over the time. Memory: the
  compiled program's temp bytes (XLA ``memory_analysis``).
* ``attention``, bf16, ``[B, T, N, H]``, (B, N, T, H) in (4, 32, 4096, 128),
  (1, 32, 16384, 128), (8, 16, 2048, 64), causal and not, and (2, 32, 8192, 128) not
  causal (for "forward >= 60% of peak at length 8192"); forward, and forward + backward
  (``jax.vjp`` and the pullback of a random cotangent in one jit). FLOPs, FlashAttention's
  count: forward ``4 B N T^2 H`` (two matmuls), halved when causal; backward 2.5x the
  forward (five matmuls against two), so forward + backward = 3.5x the forward, whatever
  an implementation recomputes. Implementations:

  - ``jaxpar``: ``jaxpar.kernels.flash_attention(q, k, v, causal=...)``;
  - ``cudnn`` and ``xla``: ``jax.nn.dot_product_attention(..., implementation=...)``;
  - ``jax-triton``: ``jax.experimental.pallas.ops.gpu.attention.mha(q, k, v,
    segment_ids, sm_scale, causal, block_sizes, ...)``, Triton, ``[B, T, N, H]``, N == K,
    its default blocks (forward 128 x 128, backward 32), causal forward and backward;
  - ``jax-mgpu``: ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention(q, k, v,
    TuningConfig(...))``, Mosaic GPU (FlashAttention-3 style: TMA, wgmma, warp
    specialisation), Hopper only, ``[B, T, N, H]``, GQA, blocks 64 x 128 forward and
    64 backward; no softmax-scale argument, so it gets ``q / sqrt(H)`` prepared outside
    the timed call; its backward refuses causal; its shared memory is declared float16
    (JAX 0.10), so where bf16 fails it runs on float16 inputs, marked ``(f16)``.

  ``err``: ||out - ref|| / ||ref|| against float32 XLA attention at highest precision,
  on batch 0 and the first 4 heads (forward + backward: the worst of out, dq, dk, dv).
* ``decode``: ``jaxpar.kernels.decode_attention`` over a filled bf16 cache (N=32 query
  heads, K=8 kv heads, H=128; batch 1 and 8; S = lengths = 4096, 16384, 32768; T = 1
  and 5 new tokens in the last T slots, causal among them): GB/s of cache read,
  ``2 B S K H`` x 2 bytes, against copy bandwidth; beside ``jax.nn.dot_product_attention``
  with the same mask (``xla``; ``cudnn``, by ``key_value_seq_lengths`` for T = 1) and JAX's
  Pallas ``decode_attention.gqa`` (one query per kv-head group: the T tokens folded into
  the group, so not causal among themselves; its ``[B, S, K, H] -> [B, K, S, H]``
  transposes are part of it and counted); ``jaxpar-paged``:
  ``jaxpar.kernels.paged_decode_attention`` over the same cache seen as one layer of
  16-slot pages (a reshape) read through page tables, the pages in order (so the same
  bytes as ``jaxpar``: the table reads and per-row addresses are the difference; a
  shuffled pool moves 16-slot blocks of ``K H`` values, each as contiguous). Up to 8
  input sets are chained in one jit (``optimization_barrier`` between calls) and the
  time divided, so that microsecond kernels are not timed as dispatch. ``err`` against float32 XLA attention.
* ``gmm``: ``jaxpar.kernels.grouped_matmul`` (the MoE layer's grouped matmul on GPU)
  beside ``jax.lax.ragged_dot``'s default lowering, bf16 ``[M, K] x [G, K, N]``, by default
  Mixtral 8x7B's up projection over 8192 tokens x 2 experts (16384 x 4096 x 14336, G=8),
  skewed group sizes (Dirichlet(0.5) shares) with one group empty; forward, and forward +
  backward (input and weight gradients). FLOPs ``2 M K N`` (x3 forward + backward), the
  useful work whatever an implementation computes. ``err`` against float32 ``ragged_dot``
  at highest precision. Left out of ``--smoke`` unless ``--parts`` names it.
* ``train``: the ``1b`` training step with ``execution.attention=pallas``, ``xla`` and ``cudnn``
  (``jaxpar-train`` in child processes, after the kernels, which also run in a child so
  that the GPU memory is free again): median step time of the steps after
  ``--train-warmup``, tokens/s and MFU (``flops_per_token``: 6N + attention, PaLM's
  count) over the measured matmul peak and over 989 TFLOP/s. Batch ``--train-batch`` (8:
  the config's 64 does not fit one GPU), Python's stdlib as text (``data.max_files=200``,
  the tokenizer trained once), no evals, no checkpoint (``Checkpoints.save`` patched out
  in the child: 15 GB). ``--skip-train`` leaves it out; a failed run shows its last
  error line.

Timing (``/work/.library/device/METHOD.md``): every callable jitted and warmed up
(``--warmup`` calls, the first compiles), then the median of up to ``--repeats``
samples in ``--budget-s`` (at least 3); a sample is enough back-to-back calls, rotating
2-8 random input sets (never zeros; at least 256 MB in all, so repeats do not run
from the L2), to last ``--min-sample-ms``, then ``jax.block_until_ready``. Every
implementation runs under try/except: a failure (unsupported shape, out of memory, a
kernel not there: ``missing``) shows briefly in its cell and the run goes on. Past
``--time-limit-s`` (560: the lease's 10-minute call), measurements not yet started show
"skipped: time limit" (``--train-reserve-s`` of it kept for the training runs); run
those again with ``--parts``.

Options: [--parts ceilings norms ce attention decode gmm train] [--skip-train] [--smoke]
[--attention-shapes BxNxTxH[:causal|:noncausal] ...] [--attention-impls jaxpar cudnn xla
jax-triton jax-mgpu] [--decode-batches 1 8] [--decode-lengths 4096 16384 32768]
[--decode-new-tokens 1 5] [--decode-impls jaxpar jaxpar-paged xla cudnn jax-pallas-gqa]
[--decode-heads 32 8 128] [--norm-kinds rms layer] [--norm-shape 16384 4096]
[--ce-shape 8192 2048 128256] [--gmm-shape 16384 4096 14336 8] [--train-config 1b]
[--train-impls pallas xla cudnn]
[--train-steps 7] [--train-warmup 2] [--train-batch 8] [--train-overrides k=v ...]
[--train-timeout 180] [--warmup 2] [--repeats 20] [--budget-s 0.3] [--min-sample-ms 2]
[--time-limit-s 560] [--train-reserve-s 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import json
import math
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("ceilings", "norms", "ce", "attention", "decode", "gmm", "train")
ATTENTION_IMPLS = ("jaxpar", "cudnn", "xla", "jax-triton", "jax-mgpu")
DECODE_IMPLS = ("jaxpar", "jaxpar-paged", "xla", "cudnn", "jax-pallas-gqa")
NOMINAL_PEAK = 989e12  # H100 / H200 SXM dense bf16, for the MFU beside the measured one
ROTATE_BYTES = 256 * 2**20  # input sets in rotation hold at least this much (L2: 50-60 MB)


class Unavailable(Exception):
    """An implementation that cannot run here (``missing``, ``needs GPU``): its cell text."""


def short(e: BaseException, limit: int = 90) -> str:
    """One table cell's worth of an exception."""
    if isinstance(e, Unavailable):
        return str(e)
    lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
    if lines:
        text = f"{type(e).__name__}: {lines[0]}"
    else:  # a bare assert: where it failed
        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        text = type(e).__name__ + (f" at {pathlib.Path(frame.filename).name}:{frame.lineno}" if frame else "")
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------- jaxpar import


def _jaxpar_importable() -> None:
    """Where jaxpar is not installed (the GPU machine's image), import it from this
    checkout: ``jaxpar/`` from the repository root, and ``jaxpar.kernels``,
    ``jaxpar.models``, ``jaxpar.train`` from ``kernels/``, ``models/``, ``train/``
    (pyproject's package-dir mapping): the package's search path holds both ``jaxpar/``
    and the root, from before its ``__init__`` runs (which imports ``jaxpar.kernels``)."""
    if "jaxpar" in sys.modules or importlib.util.find_spec("jaxpar") is not None:
        return
    spec = importlib.util.spec_from_file_location(
        "jaxpar", ROOT / "jaxpar" / "__init__.py", submodule_search_locations=[str(ROOT / "jaxpar"), str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxpar"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the baselines still run; jaxpar's cells say why not
        print(f"jaxpar does not import: {short(e)}", flush=True)
        for name in [m for m in sys.modules if m == "jaxpar" or m.startswith("jaxpar.")]:
            del sys.modules[name]


def jaxpar_kernel(name: str):
    """``jaxpar.kernels.<name>``, or ``Unavailable("missing")``."""
    try:
        module = importlib.import_module("jaxpar.kernels")
    except Exception as e:  # noqa: BLE001 - a kernel module being written may not import
        raise Unavailable(f"missing (jaxpar.kernels: {short(e, 60)})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise Unavailable("missing")
    return fn


# ------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Settings:
    warmup: int
    repeats: int
    budget_s: float
    min_sample_s: float
    gpu: bool
    interpret: bool | None  # what jaxpar's kernels get: None (compiled on GPU) or True
    max_sets: int = 8  # input sets in rotation at most (2 in the smoke: interpret mode compiles slowly)


def n_sets(set_bytes: int, s: Settings) -> int:
    """Input sets to rotate: at least 2, and enough to hold ``ROTATE_BYTES``."""
    return int(min(s.max_sets, max(2, math.ceil(ROTATE_BYTES / max(set_bytes, 1)))))


def chained(fn, count: int):
    """``fn`` over ``count`` argument sets in one function, each call ordered after the
    previous one's output by an ``optimization_barrier`` (no fusion, no reordering)."""
    def run(*sets):
        outs, prev = [], None
        for args in sets:
            if prev is not None:
                prev, args = jax.lax.optimization_barrier((prev, args))
            prev = fn(*args)
            outs.append(prev)
        return outs
    assert count >= 1
    return run


def measure(fn, sets: list[tuple], s: Settings, *, chain: bool = False) -> dict:
    """Median seconds per call of ``jax.jit(fn)`` over the rotating ``sets``; with
    ``chain`` all sets run inside one jitted call (divided by their count). Returns
    ``{"s", "samples", "calls", "out"}`` (``out``: the output on ``sets[0]``)."""
    if chain:
        f = jax.jit(chained(fn, len(sets)))
        groups, per_call = [tuple(sets)], len(sets)
        first = lambda out: out[0]  # noqa: E731
    else:
        f = jax.jit(fn)
        groups, per_call = sets, 1
        first = lambda out: out  # noqa: E731
    out0 = jax.block_until_ready(f(*groups[0]))
    for i in range(1, s.warmup):
        jax.block_until_ready(f(*groups[i % len(groups)]))
    began = time.perf_counter()
    jax.block_until_ready(f(*groups[0]))
    estimate = max(time.perf_counter() - began, 1e-7)
    calls = max(1, min(10_000, math.ceil(s.min_sample_s / estimate)))
    samples, i = [], 0
    deadline = time.perf_counter() + s.budget_s
    while len(samples) < s.repeats and (len(samples) < 3 or time.perf_counter() < deadline):
        began = time.perf_counter()
        for _ in range(calls):
            out = f(*groups[i % len(groups)])
            i += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - began) / calls / per_call)
    return {"s": statistics.median(samples), "samples": len(samples), "calls": calls * per_call,
            "out": first(out0)}


def highest():
    """Float32 matmuls at full precision for the references (no TF32)."""
    try:
        return jax.default_matmul_precision("highest")
    except Exception:  # noqa: BLE001 - the references are then at the default precision
        return contextlib.nullcontext()


def expected_value(fn, *args):
    """``jax.jit(fn)(*args)``, the reference the errors are taken against; None (errors
    '-') if it cannot be computed."""
    try:
        return jax.jit(fn)(*args)
    except Exception as e:  # noqa: BLE001
        print(f"  (no reference: {short(e)})", flush=True)
        return None


def worst(*errs):
    return None if any(e is None for e in errs) else max(errs)


def rel_err(got, want) -> float | None:
    """||got - want|| / ||want||; None without a reference."""
    if want is None:
        return None
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    den = float(jnp.linalg.norm(want.ravel()))
    num = float(jnp.linalg.norm((got - want).ravel()))
    return num / den if den else num


def max_err(got, want) -> float | None:
    if want is None:
        return None
    return worst(*(rel_err(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))))


DEADLINE = math.inf  # time.time() past which no measurement starts (--time-limit-s)
SKIPPED = "skipped: time limit"


def attempt(fn) -> dict:
    """``fn()``'s dict, or ``{"error": ...}``; memory of a failed attempt released."""
    if time.time() > DEADLINE:
        return {"error": SKIPPED}
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - every failure becomes a table cell
        result = {"error": short(e), "trace": traceback.format_exc()[-2500:]}
    gc.collect()
    return result


def normal(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


# ------------------------------------------------------------------------ formats


def num(x: float) -> str:
    """A rate: whole above 100, three significant digits below."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def cell(result: dict, key: str) -> str:
    """A result's figure, or '-' (failed, or not measured)."""
    value = None if "error" in result else result.get(key)
    return "-" if value is None else num(value)


def outcome(r: dict) -> str:
    return r["error"] if "error" in r else f"{r['s'] * 1e3:.3f} ms"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ms_or_error(r: dict) -> str:
    return r["error"] if "error" in r else f"{r['s'] * 1e3:.3f}"


def err_cell(r: dict) -> str:
    if "error" in r:
        return "-"
    e = r.get("err")
    return "-" if e is None else f"{e:.1e}"


# ----------------------------------------------------------------------- ceilings


def ceilings(s: Settings, smoke: bool) -> dict:
    keys = jax.random.split(jax.random.key(0), 8)
    n = 256 if smoke else 8192
    mats = [(normal(keys[2 * i], (n, n), jnp.bfloat16), normal(keys[2 * i + 1], (n, n), jnp.bfloat16))
            for i in range(2)]
    mm = measure(jnp.dot, mats, s)
    del mats
    elements = (1 << 20) if smoke else (1 << 29)  # bf16: 2 MiB / 1 GiB
    xs = [(normal(keys[4 + i], (elements,), jnp.bfloat16),) for i in range(2)]
    copy = measure(jnp.copy, xs, s)  # an XLA copy: a device-to-device memcpy
    neg = measure(jnp.negative, xs, s)  # a streaming kernel: read, write
    del xs
    copy_bytes = 2 * elements * 2
    best = min(copy["s"], neg["s"])
    return {"matmul_n": n, "matmul_s": mm["s"], "peak_flops": 2 * n**3 / mm["s"], "copy_bytes": copy_bytes,
            "memcpy_s": copy["s"], "negate_s": neg["s"], "copy_s": best, "copy_bw": copy_bytes / best}


def ceilings_table(c: dict) -> str:
    n = c["matmul_n"]
    return table(["ceiling", "size", "ms", "rate"], [
        ["bf16 matmul (jnp.dot)", f"{n}^3", f"{c['matmul_s'] * 1e3:.3f}", f"{num(c['peak_flops'] / 1e12)} TFLOP/s"],
        ["copy (jnp.copy: memcpy)", f"{c['copy_bytes'] / 2 / 1e9:.3f} GB in + out", f"{c['memcpy_s'] * 1e3:.3f}",
         f"{num(c['copy_bytes'] / c['memcpy_s'] / 1e9)} GB/s"],
        ["copy (y = -x)", f"{c['copy_bytes'] / 2 / 1e9:.3f} GB in + out", f"{c['negate_s'] * 1e3:.3f}",
         f"{num(c['copy_bytes'] / c['negate_s'] / 1e9)} GB/s"],
        ["copy bandwidth used below (the faster)", "", "", f"{num(c['copy_bw'] / 1e9)} GB/s"],
    ])


# ---------------------------------------------------------------------- attention


def parse_shape(text: str) -> list[tuple[int, int, int, int, bool]]:
    dims, _, mode = text.partition(":")
    B, N, T, H = (int(x) for x in dims.lower().split("x"))
    modes = {"": (True, False), "both": (True, False), "causal": (True,), "noncausal": (False,)}[mode]
    return [(B, N, T, H, c) for c in modes]


@dataclasses.dataclass
class Variant:
    """One way to run an implementation: the call, how its inputs are prepared (outside
    the timed call), and the factor that turns its dq into the dq of the original q."""

    label: str
    fn: object
    prep: object = None
    dq_factor: float = 1.0


def attention_variants(impl: str, causal: bool, H: int, s: Settings) -> list[Variant]:
    scale = H**-0.5
    if impl == "jaxpar":
        fa = jaxpar_kernel("flash_attention")
        return [Variant("jaxpar", lambda q, k, v: fa(q, k, v, causal=causal, interpret=s.interpret))]
    if impl in ("cudnn", "xla"):
        if impl == "cudnn" and not s.gpu:
            raise Unavailable("needs GPU")
        return [Variant(impl, lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl))]
    if impl == "jax-triton":
        from jax.experimental.pallas.ops.gpu import attention as triton_mha
        return [Variant(impl, lambda q, k, v: triton_mha.mha(
            q, k, v, None, sm_scale=scale, causal=causal, interpret=not s.gpu))]
    if impl == "jax-mgpu":
        if not s.gpu:
            raise Unavailable("needs GPU")
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
        config = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
                                   compute_wgs_bwd=2 if H <= 128 else 1, block_q_dkv=64,
                                   block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
        run = lambda q, k, v: mgpu.attention(q, k, v, config)  # noqa: E731
        return [Variant(impl, run, lambda q, k, v: (q * scale, k, v), scale),
                Variant(impl + " (f16)", run,
                        lambda q, k, v: ((q * scale).astype(jnp.float16), k.astype(jnp.float16),
                                         v.astype(jnp.float16)), scale)]
    raise ValueError(f"unknown attention implementation {impl!r}")


def attention_part(args, s: Settings) -> list[dict]:
    shapes = [x for text in args.attention_shapes for x in parse_shape(text)]
    results = []
    for B, N, T, H, causal in shapes:
        fwd_flops = 4 * B * N * T * T * H / (2 if causal else 1)
        if time.time() > DEADLINE:
            results += [{"B": B, "N": N, "T": T, "H": H, "causal": causal, "impl": impl, "fwd": {"error": SKIPPED},
                         "fwdbwd": {"error": SKIPPED}} for impl in args.attention_impls]
            continue
        set_bytes = 4 * B * T * N * H * 2
        count = n_sets(set_bytes, s)
        base = jax.random.key(hash((B, N, T, H)) % 2**31)
        sets = []
        for i in range(count):
            kq, kk, kv, kd = jax.random.split(jax.random.fold_in(base, i), 4)
            sets.append(tuple(normal(key, (B, T, N, H), jnp.bfloat16) for key in (kq, kk, kv, kd)))
        heads = min(N, 4)
        sl = (slice(0, 1), slice(None), slice(0, heads))

        def reference(q, k, v, do):
            with highest():
                o, pull = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="xla"), q, k, v)
                return o, pull(do)
        ref_o, ref_grads = expected_value(reference, *(x[sl].astype(jnp.float32) for x in sets[0])) or (None, [None] * 3)

        for impl in args.attention_impls:
            row = {"B": B, "N": N, "T": T, "H": H, "causal": causal, "impl": impl,
                   "fwd_flops": fwd_flops, "fwdbwd_flops": 3.5 * fwd_flops}
            try:
                variants = attention_variants(impl, causal, H, s)
            except Exception as e:  # noqa: BLE001
                row["fwd"] = row["fwdbwd"] = {"error": short(e)}
                results.append(row)
                continue
            tried = []
            for variant in variants:
                prep = variant.prep or (lambda q, k, v: (q, k, v))

                def fwd_run(variant=variant, prep=prep):
                    vsets = [(*prep(*x[:3]),) for x in sets]
                    r = measure(variant.fn, vsets, s)
                    r["err"] = rel_err(r.pop("out")[sl], ref_o)
                    return r

                def fwdbwd_run(variant=variant, prep=prep):
                    def fwdbwd(q, k, v, do):
                        o, pull = jax.vjp(variant.fn, q, k, v)
                        return (o, *pull(do))
                    vsets = []
                    for x in sets:
                        q, k, v = prep(*x[:3])
                        vsets.append((q, k, v, x[3].astype(q.dtype)))
                    r = measure(fwdbwd, vsets, s)
                    o, dq, dk, dv = r.pop("out")
                    r["err"] = worst(rel_err(o[sl], ref_o), rel_err(dq[sl] * variant.dq_factor, ref_grads[0]),
                                     rel_err(dk[sl], ref_grads[1]), rel_err(dv[sl], ref_grads[2]))
                    return r

                fwd = attempt(fwd_run)
                if "error" in fwd and variant is not variants[-1]:
                    tried.append(f"{variant.label}: {fwd['error']}")
                    continue
                row["impl"] = variant.label
                row["fwd"], row["fwdbwd"] = fwd, attempt(fwdbwd_run)
                break
            if tried:
                row["fallback_errors"] = tried
            for mode in ("fwd", "fwdbwd"):
                r = row[mode]
                if "error" not in r:
                    r["tflops"] = row[f"{mode}_flops"] / r["s"] / 1e12
            results.append(row)
            print(f"  attention {B}x{N}x{T}x{H} {'causal' if causal else 'full'} {row['impl']}: "
                  f"fwd {outcome(row['fwd'])}, fwd+bwd {outcome(row['fwdbwd'])}", flush=True)
        sets = []  # released before the next shape
        gc.collect()
    return results


def attention_table(rows: list[dict], peak: float | None) -> str:
    cudnn = {(r["B"], r["N"], r["T"], r["H"], r["causal"]): r["fwdbwd"] for r in rows
             if r["impl"] == "cudnn" and "error" not in r["fwdbwd"]}
    out = []
    for r in rows:
        key = (r["B"], r["N"], r["T"], r["H"], r["causal"])
        f, fb = r["fwd"], r["fwdbwd"]
        pct = lambda x: "-" if "error" in x or not peak else f"{x['tflops'] * 1e12 / peak * 100:.0f}%"  # noqa: E731
        vs = "-"
        if key in cudnn and "error" not in fb:
            vs = f"{cudnn[key]['s'] / fb['s']:.2f}"
        out.append([f"{r['B']}x{r['N']}x{r['T']}x{r['H']}", "yes" if r["causal"] else "no", r["impl"],
                    ms_or_error(f), cell(f, "tflops"), pct(f), err_cell(f),
                    ms_or_error(fb), cell(fb, "tflops"), pct(fb), vs, err_cell(fb)])
    return table(["BxNxTxH", "causal", "impl", "fwd ms", "fwd TFLOP/s", "fwd % peak", "fwd err",
                  "fwd+bwd ms", "fwd+bwd TFLOP/s", "fwd+bwd % peak", "cuDNN time / this (fwd+bwd)",
                  "fwd+bwd err"], out)


# ------------------------------------------------------------------------- decode

PAGE = 16  # jaxpar-paged: slots per page (the serving engine's default)


def decode_part(args, s: Settings) -> list[dict]:
    N, K, H = args.decode_heads
    G = N // K
    results = []
    for B in args.decode_batches:
        for S in args.decode_lengths:
            for T in args.decode_new_tokens:
                kv_bytes = 2 * B * S * K * H * 2
                if time.time() > DEADLINE:
                    results += [{"B": B, "S": S, "T": T, "N": N, "K": K, "H": H, "impl": name, "kv_bytes": kv_bytes,
                                 "r": {"error": SKIPPED}}
                                for name in args.decode_impls]
                    continue
                count = n_sets(kv_bytes, s)
                base = jax.random.key(7919 * B + 31 * S + T)
                lengths = jnp.full((B,), S, jnp.int32)
                sets = []
                for i in range(count):
                    kq, kk, kv = jax.random.split(jax.random.fold_in(base, i), 3)
                    sets.append((normal(kq, (B, T, N, H), jnp.bfloat16), normal(kk, (B, S, K, H), jnp.bfloat16),
                                 normal(kv, (B, S, K, H), jnp.bfloat16), lengths))
                ref_args = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in sets[0]]

                def mask(n, causal=True, T=T, S=S):
                    """``[B, 1, T, S]``: the new tokens fill the last T of the ``n`` filled slots;
                    token t sees the context and the new tokens up to itself (all when not causal)."""
                    last = n[:, None, None] - T + (jnp.arange(T)[None, :, None] if causal else T - 1)
                    return (jnp.arange(S)[None, None, :] <= last)[:, None]

                def reference(q, k, v, n, causal=True):
                    with highest():
                        return jax.nn.dot_product_attention(q, k, v, mask=mask(n, causal), implementation="xla")
                ref = {}

                def expected(causal):  # T = 1: the same either way
                    causal = causal or T == 1
                    if causal not in ref:
                        ref[causal] = expected_value(lambda *a: reference(*a, causal=causal), *ref_args)
                    return ref[causal]

                impls = []
                try:
                    da = jaxpar_kernel("decode_attention")
                    impls.append(("jaxpar", lambda q, k, v, n: da(q, k, v, n, interpret=s.interpret), True))
                except Unavailable as e:
                    impls.append(("jaxpar", e, True))
                try:
                    pda = jaxpar_kernel("paged_decode_attention")
                    tables = jnp.arange(B * S // PAGE, dtype=jnp.int32).reshape(B, S // PAGE)

                    def paged(q, k, v, n):  # the cache as one layer of pages, in order (a free reshape)
                        pages = lambda x: x.reshape(1, B * S // PAGE, PAGE, K, H)  # noqa: E731
                        return pda(q, pages(k), pages(v), 0, tables, n, interpret=s.interpret)
                    impls.append(("jaxpar-paged", paged, True))
                except Unavailable as e:
                    impls.append(("jaxpar-paged", e, True))
                impls.append(("xla", lambda q, k, v, n: jax.nn.dot_product_attention(
                    q, k, v, mask=mask(n), implementation="xla"), True))
                if s.gpu:
                    if T == 1:
                        cudnn = lambda q, k, v, n: jax.nn.dot_product_attention(  # noqa: E731
                            q, k, v, key_value_seq_lengths=n, implementation="cudnn")
                    else:
                        cudnn = lambda q, k, v, n: jax.nn.dot_product_attention(  # noqa: E731
                            q, k, v, mask=mask(n), implementation="cudnn")
                    impls.append(("cudnn", cudnn, True))
                else:
                    impls.append(("cudnn", Unavailable("needs GPU"), True))

                def gqa(q, k, v, n):
                    from jax.experimental.pallas.ops.gpu import decode_attention as jda
                    folded = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K * T * G, H)
                    o = jda.gqa(folded, k, v, kv_seq_len=n, interpret=not s.gpu)
                    return o.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
                impls.append(("jax-pallas-gqa", gqa, T == 1))

                for name, fn, causal in (impl for impl in impls if impl[0] in args.decode_impls):
                    row = {"B": B, "S": S, "T": T, "N": N, "K": K, "H": H, "impl": name, "kv_bytes": kv_bytes}
                    if isinstance(fn, Exception):
                        row["r"] = {"error": short(fn)}
                    else:
                        def run(fn=fn, causal=causal):
                            r = measure(fn, sets, s, chain=True)
                            r["err"] = rel_err(r.pop("out"), expected(causal))
                            r["gbs"] = kv_bytes / r["s"] / 1e9
                            return r
                        row["r"] = attempt(run)
                    results.append(row)
                    print(f"  decode B={B} S={S} T={T} {name}: {outcome(row['r'])}", flush=True)
                sets = []  # released before the next shape
                gc.collect()
    return results


def decode_table(rows: list[dict], copy_bw: float | None) -> str:
    out = []
    for r in rows:
        x = r["r"]
        pct = "-" if "error" in x or not copy_bw else f"{x['gbs'] * 1e9 / copy_bw * 100:.0f}%"
        us = x["error"] if "error" in x else f"{x['s'] * 1e6:.1f}"
        out.append([r["B"], r["S"], r["T"], f"{r['kv_bytes'] / 1e6:.1f}", r["impl"], us,
                    cell(x, "gbs"), pct, err_cell(x)])
    return table(["B", "S", "T", "KV MB", "impl", "us", "KV GB/s", "% copy", "err"], out)


# -------------------------------------------------------------------------- norms


def norms_part(args, s: Settings) -> list[dict]:
    R, D = args.norm_shape
    results = []
    try:
        norm, reference_fn = jaxpar_kernel("norm"), jaxpar_kernel("norm_reference")
    except Unavailable as e:
        norm = reference_fn = e
    for kind in args.norm_kinds:
        count = n_sets(3 * R * D * 2, s)
        base = jax.random.key(17 if kind == "rms" else 18)
        sets = []
        for i in range(count):
            kx, ks, kb, kg = jax.random.split(jax.random.fold_in(base, i), 4)
            bias = normal(kb, (D,), jnp.float32) if kind == "layer" else None
            sets.append((normal(kx, (R, D), jnp.bfloat16, 2.0) + 0.5, 1 + normal(ks, (D,), jnp.float32, 0.1), bias,
                         normal(kg, (R, D), jnp.bfloat16)))
        impls = [("jaxpar", None if isinstance(norm, Exception) else
                  (lambda x, sc, b: norm(x, sc, b, kind=kind, interpret=s.interpret)), norm),
                 ("xla", None if isinstance(reference_fn, Exception) else
                  (lambda x, sc, b: reference_fn(x, sc, b, kind=kind)), reference_fn)]
        if not isinstance(reference_fn, Exception):
            f32 = [x.astype(jnp.float32) if x is not None else None for x in sets[0]]

            def ref(x, sc, b, g):
                y, pull = jax.vjp(lambda x, sc, b: reference_fn(x, sc, b, kind=kind), x, sc, b)
                return y, pull(g)
            ref_y, ref_grads = expected_value(ref, *f32) or (None, None)
        else:
            ref_y = ref_grads = None
        for name, fn, missing in impls:
            for mode in ("fwd", "fwdbwd"):
                row = {"kind": kind, "mode": mode, "impl": name, "R": R, "D": D,
                       "bytes": (2 if mode == "fwd" else 5) * R * D * 2}
                if fn is None:
                    row["r"] = {"error": short(missing)}
                else:
                    def run(fn=fn, mode=mode, row=row):
                        if mode == "fwd":
                            r = measure(fn, [x[:3] for x in sets], s)
                            r["err"] = rel_err(r.pop("out"), ref_y)
                        else:
                            def fwdbwd(x, sc, b, g):
                                y, pull = jax.vjp(fn, x, sc, b)
                                return y, pull(g)
                            r = measure(fwdbwd, sets, s)
                            y, grads = r.pop("out")
                            r["err"] = worst(rel_err(y, ref_y), max_err(grads, ref_grads))
                        r["gbs"] = row["bytes"] / r["s"] / 1e9
                        return r
                    row["r"] = attempt(run)
                results.append(row)
                print(f"  norm {kind} {mode} {name}: {outcome(row['r'])}", flush=True)
        sets = []  # released before the next shape
        gc.collect()
    return results


def norms_table(rows: list[dict], copy_bw: float | None) -> str:
    out = []
    for r in rows:
        x = r["r"]
        pct = "-" if "error" in x or not copy_bw else f"{x['gbs'] * 1e9 / copy_bw * 100:.0f}%"
        out.append([r["kind"], "fwd" if r["mode"] == "fwd" else "fwd+bwd", r["impl"], ms_or_error(x),
                    cell(x, "gbs"), pct, err_cell(x)])
    return table(["norm", "mode", "impl", "ms", "GB/s", "% copy", "err"], out)


# ------------------------------------------------------------------ two-operand kernels


def fwd_bwd_rows(label: str, impls, sets, s: Settings, ref_out, ref_grads, shape: dict, flops: float, *,
                 nbytes: float | None = None, temp: bool = False) -> list[dict]:
    """Rows of ``fn(a, b, c)`` per implementation ``(name, fn or None, why missing)``,
    forward and forward + backward (``jax.vjp`` through ``a`` and ``b``, the cotangent
    each set's fourth array): median time, ``tflops`` of ``flops`` (x3 with the
    backward), ``gbs`` of ``nbytes`` where given, the error against ``ref_out`` /
    ``ref_grads``, and with ``temp`` the compiled program's temporary bytes."""
    results = []
    for name, fn, missing in impls:
        for mode in ("fwd", "fwdbwd"):
            times = 1 if mode == "fwd" else 3
            row = {"mode": mode, "impl": name, **shape, "flops": times * flops}
            if nbytes is not None:
                row["bytes"] = times * nbytes
            if fn is None:
                row["r"] = {"error": short(missing)}
            else:
                row["r"] = attempt(lambda fn=fn, row=row: _fwd_bwd_run(fn, row, sets, s, ref_out, ref_grads, temp))
            results.append(row)
            print(f"  {label} {mode} {name}: {outcome(row['r'])}", flush=True)
    return results


def _fwd_bwd_run(fn, row: dict, sets, s: Settings, ref_out, ref_grads, temp: bool) -> dict:
    if row["mode"] == "fwd":
        call, call_sets = fn, [x[:3] for x in sets]
    else:
        def call(a, b, c, g):
            out, pull = jax.vjp(lambda a, b: fn(a, b, c), a, b)
            return out, pull(g)
        call_sets = sets
    r = measure(call, call_sets, s)
    out = r.pop("out")
    r["err"] = (rel_err(out, ref_out) if row["mode"] == "fwd" else
                worst(rel_err(out[0], ref_out), max_err(out[1], ref_grads)))
    r["tflops"] = row["flops"] / r["s"] / 1e12
    if "bytes" in row:
        r["gbs"] = row["bytes"] / r["s"] / 1e9
    if temp:
        try:
            analysis = jax.jit(call).lower(*call_sets[0]).compile().memory_analysis()
            r["temp_bytes"] = int(analysis.temp_size_in_bytes)
        except Exception:  # noqa: BLE001 - a figure some backends do not give
            r["temp_bytes"] = None
    return r


# ------------------------------------------------------------------ cross-entropy


def ce_part(args, s: Settings) -> list[dict]:
    N, D, V = args.ce_shape
    try:
        ce, reference_fn = jaxpar_kernel("linear_cross_entropy"), jaxpar_kernel("linear_cross_entropy_reference")
    except Unavailable as e:
        ce = reference_fn = e
    sets = []
    for i in range(2):
        kx, kw, kt, kg = jax.random.split(jax.random.fold_in(jax.random.key(23), i), 4)
        sets.append((normal(kx, (N, D), jnp.bfloat16), normal(kw, (D, V), jnp.bfloat16, D**-0.5),
                     jax.random.randint(kt, (N,), 0, V, jnp.int32),
                     jax.random.uniform(kg, (N,), jnp.float32, 0.5, 1.5) / N))
    fwd_bytes = (N * D + D * V) * 2
    if not isinstance(reference_fn, Exception):
        def ref(x, w, t, g):
            with highest():
                loss, pull = jax.vjp(lambda x, w: reference_fn(x, w, t), x, w)
                return loss, pull(g)
        ref_loss, ref_grads = expected_value(ref, sets[0][0].astype(jnp.float32), sets[0][1].astype(jnp.float32),
                                             *sets[0][2:]) or (None, None)
    else:
        ref_loss = ref_grads = None
    impls = [("jaxpar", None if isinstance(ce, Exception) else
              (lambda x, w, t: ce(x, w, t, interpret=s.interpret)), ce),
             ("xla", None if isinstance(reference_fn, Exception) else reference_fn, reference_fn)]
    return fwd_bwd_rows("cross-entropy", impls, sets, s, ref_loss, ref_grads, {"N": N, "D": D, "V": V},
                        2 * N * D * V, nbytes=fwd_bytes, temp=True)


def ce_table(rows: list[dict], peak: float | None, copy_bw: float | None) -> str:
    out = []
    for r in rows:
        x = r["r"]
        ok = "error" not in x
        out.append([f"{r['N']}x{r['D']}x{r['V']}", "fwd" if r["mode"] == "fwd" else "fwd+bwd", r["impl"],
                     ms_or_error(x), cell(x, "tflops"),
                     f"{x['tflops'] * 1e12 / peak * 100:.0f}%" if ok and peak else "-",
                     cell(x, "gbs"), f"{x['gbs'] * 1e9 / copy_bw * 100:.1f}%" if ok and copy_bw else "-",
                     "-" if not ok or x.get("temp_bytes") is None else f"{x['temp_bytes'] / 1e9:.3f}",
                     err_cell(x)])
    return table(["NxDxV", "mode", "impl", "ms", "TFLOP/s", "% peak", "GB/s (x, w)", "% copy",
                  "temp GB (compiled)", "err"], out)


# ------------------------------------------------------------------ grouped matmul


def gmm_sizes(key, M: int, G: int):
    """``[G]`` int32 group sizes summing to ``M``, skewed (Dirichlet(0.5) shares, as a
    router's uneven load) with group 1 empty."""
    share = jax.random.dirichlet(key, jnp.full((G,), 0.5)).at[1 % G].set(0.0)
    sizes = jnp.floor(share / share.sum() * M).astype(jnp.int32)
    return sizes.at[0].add(M - sizes.sum())


def gmm_part(args, s: Settings) -> list[dict]:
    """``jaxpar.kernels.grouped_matmul`` against ``jax.lax.ragged_dot``'s default lowering
    (``grouped_matmul_reference``), bf16 ``[M, K] x [G, K, N]``, forward and forward +
    backward; FLOPs ``2 M K N`` (x3 forward + backward), whatever an implementation
    computes beyond (the dense rewrite: G times). ``err`` against float32 ``ragged_dot``
    at highest precision."""
    M, K, N, G = args.gmm_shape
    try:
        gmm, reference_fn = jaxpar_kernel("grouped_matmul"), jaxpar_kernel("grouped_matmul_reference")
    except Unavailable as e:
        gmm = reference_fn = e
    sets = []
    for i in range(n_sets((M * K + G * K * N + M * N) * 2, s)):
        kx, kw, ks, kg = jax.random.split(jax.random.fold_in(jax.random.key(29), i), 4)
        sets.append((normal(kx, (M, K), jnp.bfloat16), normal(kw, (G, K, N), jnp.bfloat16, K**-0.5),
                     gmm_sizes(ks, M, G), normal(kg, (M, N), jnp.bfloat16)))
    ref_out = ref_grads = None
    if not isinstance(reference_fn, Exception):
        def ref(x, w, sizes, g):
            with highest():
                out, pull = jax.vjp(lambda x, w: reference_fn(x, w, sizes), x, w)
                return out, pull(g)
        x, w, sizes, g = sets[0]
        ref_out, ref_grads = expected_value(ref, x.astype(jnp.float32), w.astype(jnp.float32), sizes,
                                            g.astype(jnp.float32)) or (None, None)
    impls = [("jaxpar", None if isinstance(gmm, Exception) else
              (lambda x, w, sizes: gmm(x, w, sizes, interpret=s.interpret)), gmm),
             ("ragged_dot", None if isinstance(reference_fn, Exception) else reference_fn, reference_fn)]
    return fwd_bwd_rows("grouped matmul", impls, sets, s, ref_out, ref_grads, {"M": M, "K": K, "N": N, "G": G},
                        2 * M * K * N)


def gmm_table(rows: list[dict], peak: float | None) -> str:
    out = []
    for r in rows:
        x = r["r"]
        ok = "error" not in x
        out.append([f"{r['M']}x{r['K']}x{r['N']} G{r['G']}", "fwd" if r["mode"] == "fwd" else "fwd+bwd", r["impl"],
                    ms_or_error(x), cell(x, "tflops"),
                    f"{x['tflops'] * 1e12 / peak * 100:.0f}%" if ok and peak else "-", err_cell(x)])
    return table(["MxKxN G", "mode", "impl", "ms", "TFLOP/s (2MKN)", "% peak", "err"], out)


# -------------------------------------------------------------------------- train


def train_child(argv: list[str]) -> int:
    """``jaxpar-train`` as the benchmark runs it (see the module docstring): jaxpar
    importable from this checkout, no checkpoint written (TensorBoard events only where
    tensorboardX is installed: the GPU image lacks it)."""
    _jaxpar_importable()
    from jaxpar.train import loop

    class NoSave(loop.Checkpoints):
        def save(self, *args, **kwargs):
            return None

    loop.Checkpoints = NoSave
    from jaxpar.commands.train import main as cli_main

    return cli_main(argv)


def train_part(args) -> list[dict]:
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxpar-bench-train-"))
    cache = work / "cache"
    base = [f"steps={args.train_steps}", f"batch_size={args.train_batch}", "eval.every=0",
            "checkpoint.every=0", f"cache_dir={cache}", *args.train_overrides]
    results = []
    try:
        for impl in args.train_impls:
            run_dir = work / f"run-{impl}"
            overrides = [*base, f"run_dir={run_dir}", f"execution.attention={impl}"]
            row = {"config": args.train_config, "impl": impl, "overrides": overrides}
            began = time.perf_counter()
            timeout = min(args.train_timeout, DEADLINE - time.time())
            if timeout < 20:
                row["error"] = SKIPPED
                results.append(row)
                print(f"  train {args.train_config} execution.attention={impl}: {SKIPPED}", flush=True)
                continue
            try:
                proc = subprocess.run(
                    [sys.executable, str(pathlib.Path(__file__).resolve()), "--train-child",
                     args.train_config, *overrides, "--no-progress", "--simulate-devices", "1"],
                    cwd=ROOT, capture_output=True, text=True, timeout=timeout)
                row["wall_s"] = time.perf_counter() - began
                metrics = run_dir / "metrics.jsonl"
                steps = ([json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
                         if metrics.exists() else [])
                timed = [m["step_time_s"] for m in steps[args.train_warmup:]]
                if proc.returncode != 0 or not timed:
                    lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
                    reason = lines[-1].strip() if lines else f"exit {proc.returncode}"
                    if proc.returncode == 0:
                        reason = f"{len(steps)} steps logged, none after the {args.train_warmup} warm-up ones"
                    row["error"] = short(RuntimeError(reason), 120).removeprefix("RuntimeError: ")
                    row["stderr_tail"] = proc.stderr[-3000:]
                else:
                    row["step_s"] = statistics.median(timed)
                    row["step_times"] = [m["step_time_s"] for m in steps]
                    row["loss"] = steps[-1]["loss"]
            except subprocess.TimeoutExpired:
                row["error"] = f"timed out after {timeout:.0f} s"
            results.append(row)
            shutil.rmtree(run_dir, ignore_errors=True)
            said = row["error"] if "error" in row else f"{row['step_s'] * 1e3:.0f} ms/step"
            print(f"  train {args.train_config} execution.attention={impl}: {said} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    try:
        from jaxpar.train.config import load_config

        from jaxpar.train.loop import flops_per_token

        cfg = load_config(args.train_config, [f"batch_size={args.train_batch}", *args.train_overrides])
        for row in results:
            row["tokens_per_step"] = cfg.batch_size * cfg.seq_len
            row["flops_per_token"] = flops_per_token(cfg)
    except Exception as e:  # noqa: BLE001
        for row in results:
            row.setdefault("error", f"config: {short(e)}")
    return results


def train_table(rows: list[dict], peak: float | None) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["config"], r["impl"], r["error"], "-", "-", "-", "-"])
            continue
        tps = r["tokens_per_step"] / r["step_s"]
        achieved = r["flops_per_token"] * tps
        out.append([r["config"], r["impl"], f"{r['step_s'] * 1e3:.0f}", f"{tps:,.0f}",
                    f"{achieved / peak * 100:.1f}%" if peak else "-", f"{achieved / NOMINAL_PEAK * 100:.1f}%",
                    f"{r['loss']:.3f}"])
    return table(["config", "execution.attention", "step ms (median)", "tokens/s", "MFU (measured peak)",
                  "MFU (989 TFLOP/s)", "last loss"], out)


# ------------------------------------------------------------------------ targets


def targets_table(res: dict) -> str:
    rows = _targets(res)
    if res.get("backend") != "gpu":  # interpret mode on a CPU: figures, no verdicts
        rows = [[goal, got, verdict if verdict == "-" else "no verdict off GPU"] for goal, got, verdict in rows]
    return table(["target (issue)", "jaxpar measured", "verdict"], rows)


def _targets(res: dict) -> list[list[str]]:
    c = res.get("ceilings") or {}
    peak, copy_bw = c.get("peak_flops"), c.get("copy_bw")
    rows = []
    att = res.get("attention") or []
    ratios = []
    for r in att:
        if r["impl"] != "jaxpar" or "error" in r["fwdbwd"]:
            continue
        for other in att:
            if (other["impl"] == "cudnn" and "error" not in other["fwdbwd"]
                    and all(other[k] == r[k] for k in ("B", "N", "T", "H", "causal"))):
                ratios.append((other["fwdbwd"]["s"] / r["fwdbwd"]["s"],
                               f"{r['B']}x{r['N']}x{r['T']}x{r['H']}{' causal' if r['causal'] else ''}"))
    if ratios:
        worst = min(ratios)
        rows.append(["attention fwd+bwd >= 0.8x cuDNN (speed, worst shape)", f"{worst[0]:.2f} at {worst[1]}",
                     "met" if worst[0] >= 0.8 else "not met"])
    else:
        rows.append(["attention fwd+bwd >= 0.8x cuDNN (speed, worst shape)", "no jaxpar and cuDNN pair measured", "-"])
    long = [r for r in att if r["impl"] == "jaxpar" and r["T"] == 8192 and not r["causal"] and "error" not in r["fwd"]]
    if long and peak:
        frac = min(r["fwd"]["tflops"] * 1e12 / peak for r in long)
        rows.append(["attention fwd >= 60% of measured peak, T=8192 not causal", f"{frac * 100:.0f}%",
                     "met" if frac >= 0.6 else "not met"])
    else:
        rows.append(["attention fwd >= 60% of measured peak, T=8192 not causal", "not measured", "-"])
    norms = [r for r in res.get("norms") or [] if r["impl"] == "jaxpar" and "error" not in r["r"]]
    if norms and copy_bw:
        worst = min(norms, key=lambda r: r["r"]["gbs"])
        frac = worst["r"]["gbs"] * 1e9 / copy_bw
        rows.append(["norms >= 80% of copy bandwidth (worst)", f"{frac * 100:.0f}% ({worst['kind']} {worst['mode']})",
                     "met" if frac >= 0.8 else "not met"])
    else:
        rows.append(["norms >= 80% of copy bandwidth (worst)", "not measured", "-"])
    ce = [r for r in res.get("ce") or [] if r["impl"] == "jaxpar" and "error" not in r["r"]]
    if ce and copy_bw and peak:
        parts = []
        worst = 1.0
        for r in ce:
            floor = max(r["flops"] / peak, r["bytes"] / copy_bw)  # the roofline's time
            frac = floor / r["r"]["s"]
            worst = min(worst, frac)
            parts.append(f"{r['mode']}: {r['r']['gbs'] * 1e9 / copy_bw * 100:.1f}% of copy, "
                         f"{r['r']['tflops'] * 1e12 / peak * 100:.0f}% of peak")
        rows.append(["cross-entropy >= 80% of copy bandwidth (compute-bound at this shape: "
                     "judged as time floor / time)", "; ".join(parts) + f"; roofline {worst * 100:.0f}%",
                     "met" if worst >= 0.8 else "not met"])
    else:
        rows.append(["cross-entropy >= 80% of copy bandwidth", "not measured", "-"])
    dec = [r for r in res.get("decode") or [] if r["impl"] == "jaxpar" and "error" not in r["r"]]
    if dec and copy_bw:
        worst = min(dec, key=lambda r: r["r"]["gbs"])
        big = max(dec, key=lambda r: (r["kv_bytes"], -r["T"]))
        wf, bf = worst["r"]["gbs"] * 1e9 / copy_bw, big["r"]["gbs"] * 1e9 / copy_bw
        rows.append(["decode >= 70% of copy bandwidth",
                     f"largest cache (B={big['B']} S={big['S']} T={big['T']}): {bf * 100:.0f}%; worst "
                     f"(B={worst['B']} S={worst['S']} T={worst['T']}): {wf * 100:.0f}%",
                     "met" if wf >= 0.7 else ("met at the largest cache" if bf >= 0.7 else "not met")])
    else:
        rows.append(["decode >= 70% of copy bandwidth", "not measured", "-"])
    return rows


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--skip-train", action="store_true", help="leave out the training step part")
    p.add_argument("--smoke", action="store_true",
                   help="CPU correctness smoke: tiny shapes, Pallas interpret mode, few repeats")
    p.add_argument("--json", metavar="PATH", help="write every figure (and error) here")
    p.add_argument("--attention-shapes", nargs="+", metavar="BxNxTxH[:causal|:noncausal]",
                   default=["4x32x4096x128", "1x32x16384x128", "8x16x2048x64", "2x32x8192x128:noncausal"])
    p.add_argument("--attention-impls", nargs="+", choices=ATTENTION_IMPLS, default=list(ATTENTION_IMPLS))
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--decode-new-tokens", type=int, nargs="+", default=[1, 5])
    p.add_argument("--decode-impls", nargs="+", choices=DECODE_IMPLS, default=list(DECODE_IMPLS))
    p.add_argument("--decode-heads", type=int, nargs=3, default=[32, 8, 128], metavar=("N", "K", "H"))
    p.add_argument("--norm-kinds", nargs="+", choices=("rms", "layer"), default=["rms", "layer"],
                   help="the norms part's RMSNorm and LayerNorm (both)")
    p.add_argument("--norm-shape", type=int, nargs=2, default=[16384, 4096], metavar=("ROWS", "D"))
    p.add_argument("--ce-shape", type=int, nargs=3, default=[8192, 2048, 128256], metavar=("N", "D", "V"))
    p.add_argument("--gmm-shape", type=int, nargs=4, default=[16384, 4096, 14336, 8], metavar=("M", "K", "N", "G"))
    p.add_argument("--train-config", default="1b")
    p.add_argument("--train-impls", nargs="+", default=["pallas", "xla", "cudnn"])
    p.add_argument("--train-steps", type=int, default=7)
    p.add_argument("--train-warmup", type=int, default=2, help="first steps left out of the median (compile)")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-overrides", nargs="*", default=["data.max_files=200"], metavar="KEY=VALUE")
    p.add_argument("--train-timeout", type=int, default=180, help="seconds per training run at most")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=0.3, help="seconds of timed samples per measurement")
    p.add_argument("--min-sample-ms", type=float, default=2.0)
    p.add_argument("--time-limit-s", type=float, default=560.0,
                   help="past this, measurements not yet started are skipped (the tables still print)")
    p.add_argument("--train-reserve-s", type=float, default=200.0,
                   help="of the time limit, kept for the training runs")
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:  # tiny everything unless given
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        smoke = {"--attention-shapes": ["1x2x256x64"], "--decode-batches": [2], "--decode-lengths": [256],
                 "--decode-new-tokens": [1, 3], "--decode-heads": [4, 2, 64], "--norm-shape": [64, 256],
                 "--ce-shape": [64, 128, 512], "--gmm-shape": [64, 32, 48, 4], "--train-config": "tiny",
                 "--train-impls": ["xla"], "--train-steps": 3,
                 "--train-warmup": 1, "--train-batch": 2,
                 "--train-overrides": ["seq_len=64", "data.max_files=30"],
                 "--warmup": 1, "--repeats": 2, "--budget-s": 0.0, "--min-sample-ms": 0.0}
        for flag, value in smoke.items():
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
        if "--parts" not in given and "gmm" in args.parts:  # its interpret-mode compiles are
            args.parts.remove("gmm")  # tests/test_kernels_grouped_matmul.py's; --parts gmm runs it
    if args.skip_train and "train" in args.parts:
        args.parts.remove("train")
    return args


def kernels_main(args) -> dict:
    """The kernel parts, in this process: prints their tables, returns their figures
    (also written to ``--json`` after each part)."""
    began = time.perf_counter()
    gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    res: dict = {"args": vars(args), "device": device.device_kind, "backend": jax.default_backend(),
                 "jax": jax.__version__, "smoke": args.smoke}

    def save():
        if args.json:
            path = pathlib.Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res, indent=1, default=str))

    s = Settings(warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s,
                 min_sample_s=args.min_sample_ms / 1e3, gpu=gpu, interpret=None if gpu else True,
                 max_sets=2 if args.smoke else 8)
    print(f"{device.device_kind} ({jax.default_backend()}), JAX {jax.__version__}"
          + ("; off GPU: Pallas interpret mode, a correctness smoke, not performance" if not gpu else ""),
          flush=True)
    c = res["ceilings"] = ceilings(s, args.smoke)
    save()
    print("\nCeilings, measured in this run:\n\n" + ceilings_table(c) + "\n", flush=True)
    peak, copy_bw = c["peak_flops"], c["copy_bw"]
    parts = [("norms", norms_part, lambda r: norms_table(r, copy_bw),
              "Norms (bf16 x; bytes: fwd 2 x 2 B/element, fwd+bwd 5 x 2 B/element)"),
             ("ce", ce_part, lambda r: ce_table(r, peak, copy_bw),
              "Linear + cross-entropy (bf16; FLOPs 2NDV fwd, x3 fwd+bwd; bytes: x and w per pass)"),
             ("attention", attention_part, lambda r: attention_table(r, peak),
              "Attention (bf16, [B, T, N, H]; FLOPs 4BNT^2H forward, halved if causal, x3.5 forward + backward)"),
             ("decode", decode_part, lambda r: decode_table(r, copy_bw),
              "Decode attention (bf16 KV cache filled to S; GB/s of K and V read)"),
             ("gmm", gmm_part, lambda r: gmm_table(r, peak),
              "Grouped matmul (bf16, [M, K] x [G, K, N], skewed groups, one empty; FLOPs 2MKN, x3 fwd+bwd)")]
    for name, run, render, title in parts:
        if name not in args.parts:
            continue
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        res[name] = run(args, s)
        res[f"{name}_s"] = time.perf_counter() - t0
        save()
        print(f"\n{title}, {res[f'{name}_s']:.0f} s:\n\n{render(res[name])}\n", flush=True)
    res["kernels_s"] = time.perf_counter() - began
    save()
    return res


def main(argv=None):
    global DEADLINE
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--train-child"]:
        return train_child(argv[1:])
    child = argv[:1] == ["--kernels-child"]
    args = parse_args(argv[1:] if child else argv)
    _jaxpar_importable()
    began = time.time()
    DEADLINE = args.deadline or began + args.time_limit_s
    if child:
        kernels_main(args)
        return 0
    res: dict = {}
    kernel_parts = [p for p in args.parts if p not in ("train", "ceilings")]
    if kernel_parts or "ceilings" in args.parts:
        if "train" in args.parts:
            # In a child process, so that its GPU memory is free again for the training runs.
            with tempfile.TemporaryDirectory(prefix="jaxpar-bench-") as tmp:
                out = pathlib.Path(tmp) / "kernels.json"
                cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--kernels-child", *argv,
                       "--parts", "ceilings", *kernel_parts, "--json", str(out),
                       "--deadline", str(DEADLINE - args.train_reserve_s)]
                try:
                    code = subprocess.run(cmd, cwd=ROOT, timeout=max(DEADLINE - time.time(), 1)).returncode
                except subprocess.TimeoutExpired:
                    code = "timed out"
                if out.exists():
                    res.update(json.loads(out.read_text()))
                if code != 0:
                    res["kernels_error"] = f"the kernel process ended with {code}"
                    print(res["kernels_error"] + "; figures so far kept", flush=True)
        else:
            res.update(kernels_main(args))
    res["args"] = vars(args)
    peak = (res.get("ceilings") or {}).get("peak_flops")
    if "train" in args.parts:
        print("train (child processes) ...", flush=True)
        res["train"] = train_part(args)
        print(f"\nTraining step (`{args.train_config}`, batch {args.train_batch}, median step time after "
              f"the first {args.train_warmup}):\n\n{train_table(res['train'], peak)}\n", flush=True)
    if kernel_parts:
        print(f"Targets (elapsed {time.time() - began:.0f} s):\n\n{targets_table(res)}", flush=True)
    res["elapsed_s"] = time.time() - began
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
