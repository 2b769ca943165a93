"""The ``model`` part (45 s): the model on jaxpar's kernels against it on XLA.

The ``tiny`` Transformer's loss and gradients with ``execution`` attention/norm/loss =
``pallas`` (and, on a GPU, attention = ``cudnn``) against ``xla``, on packed documents
(two per row, B=4 T=256; B=2 T=32 and one layer in ``--smoke``, where Pallas runs in
interpret mode and only the bfloat16 model does: the same code as the float32 one, with
more of its options): float32 at ``highest`` precision (loss within 1e-4, gradients 1e-3, as
relative errors), and bfloat16 with head dim 80, LayerNorm and GELU (1e-2, 5e-2). A run
not started by the part's deadline is ``skipped: time limit`` and fails the part.
"""

from __future__ import annotations

import dataclasses
import time
import traceback

from correctness import matmul_precision
from part import Record, short, time_left
from probe import need_pallas_gpu


def packed_batch(rng, vocab_size: int, B: int, T: int) -> dict:
    """Random tokens, two documents per row (segment ids, positions restarting at each)."""
    import numpy as np

    tokens = rng.integers(0, vocab_size, (B, T + 1))
    cuts = rng.integers(T // 4, 3 * T // 4, B)
    seg = (np.arange(T)[None] >= cuts[:, None]).astype(np.int32)
    pos = np.where(seg == 0, np.arange(T)[None], np.arange(T)[None] - cuts[:, None]).astype(np.int32)
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
            "positions": pos, "segment_ids": seg, "mask": np.ones((B, T), np.int32)}


def loss_and_grads(step, model, batch, impl: str, precision: str) -> dict:
    """One step's loss and gradients (float64) with ``impl``'s kernels (cuDNN: attention
    only), or its ``status`` if it failed."""
    import jax
    import numpy as np

    import jaxpar
    from jaxpar.kernels import KernelOptions

    other = "xla" if impl == "cudnn" else impl
    began = time.perf_counter()
    try:
        with matmul_precision(precision), jaxpar.use_execution(kernels=KernelOptions(attention=impl, norm=other,
                                                                                    loss=other)):
            loss, grads = step(model, batch)
        return {"loss": float(loss), "grads": [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)],
                "seconds": round(time.perf_counter() - began, 2)}
    except Exception as e:  # noqa: BLE001 - a compile or run failure is a result
        trace = traceback.format_exc()[-2500:]
        print(trace, flush=True)
        return {"status": f"failed: {short(e)}", "trace": trace}


def compare(label: str, impl: str, r: dict, base: dict, loss_tol: float, grad_tol: float) -> dict:
    """``impl``'s run against the ``xla`` one: the row of results.json."""
    import numpy as np

    execution = f"attention={impl}" + ("" if impl == "cudnn" else f" norm={impl} loss={impl}")
    row = {"model": label, "execution": execution, "loss_tolerance": loss_tol, "grad_tolerance": grad_tol}
    if "status" in base or "status" in r:
        row["status"] = r.get("status") or f"baseline {base['status']}"
        row.update({k: v for k, v in r.items() if k == "trace"})
        return row
    row["loss"], row["xla_loss"] = r["loss"], base["loss"]
    row["loss_rel"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
    row["grad_rel"] = max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                          for a, b in zip(r["grads"], base["grads"]))
    good = row["loss_rel"] <= loss_tol and row["grad_rel"] <= grad_tol
    row["status"] = "ok" if good else "failed: above tolerance"
    row["seconds"] = r["seconds"]
    return row


def part_model(ns, rec: Record) -> None:
    gpu = need_pallas_gpu(ns)
    import jax
    import numpy as np
    from flax import nnx

    import jaxpar
    from jaxpar.models import PRESETS, Transformer
    from jaxpar.train.step import loss_fn

    tiny = PRESETS["tiny"]
    variants = [
        ("tiny, float32, highest precision", tiny, "highest", ("pallas",), (1e-4, 1e-3)),
        ("tiny, bfloat16, head_dim 80, LayerNorm, GELU, vocabulary 4000",
         dataclasses.replace(tiny, dtype="bfloat16", head_dim=80, norm="layer", mlp="gelu", vocab_size=4000),
         "default", ("pallas", "cudnn") if gpu else ("pallas",), (1e-2, 5e-2)),
    ]
    B, T = (2, 32) if ns.smoke else (4, 256)
    if ns.smoke:  # interpret mode's compiles are most of the smoke's time (the CI suite runs it)
        variants = variants[1:]
    rng = np.random.default_rng(0)
    step = jaxpar.jit(lambda model, batch: nnx.value_and_grad(loss_fn)(model, batch), transform=nnx.jit)
    rec["rows"] = []
    for label, cfg, precision, impls, (loss_tol, grad_tol) in variants:
        if ns.smoke:
            cfg = dataclasses.replace(cfg, layers=1)
        batch = jax.tree.map(jax.numpy.asarray, packed_batch(rng, cfg.vocab_size, B, T))
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        results = {impl: loss_and_grads(step, model, batch, impl, precision) if time_left() >= 3
                   else {"status": "skipped: time limit"} for impl in ("xla", *impls)}
        for impl in impls:
            row = compare(label, impl, results[impl], results["xla"], loss_tol, grad_tol)
            print(f"  {label}: {row['execution']}: {row['status']}"
                  + (f" (loss {row['loss_rel']:.1e}, grads {row['grad_rel']:.1e})" if "loss_rel" in row else ""),
                  flush=True)
            rec["rows"].append(row)
            rec.save()
    rows = rec["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    rec["status"] = "ok" if len(ok) == len(rows) and rows else "failed"
    if rec["status"] == "failed":
        rec["reason"] = "; ".join(f"{r['model']}, {r['execution']}: {r['status']}" for r in rows if r["status"] != "ok")
    rec["summary"] = (f"{len(ok)}/{len(rows)} model runs agree with execution=xla (loss and gradients, B={B} T={T}, "
                      f"packed){' in interpret mode' if not gpu else ''}")
    rec["details"] = [f"  {r['model']}: {r['execution']}: {r['status']}"
                      + (f", loss {r['loss']:.5f} vs {r['xla_loss']:.5f} (rel {r['loss_rel']:.1e}), gradients rel "
                         f"{r['grad_rel']:.1e}" if "loss_rel" in r else "") for r in rows]
