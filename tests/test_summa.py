"""SUMMA products (jaxpar.parallel.summa): the three forms and their gradients against jnp, on
2x2, 3x3 and 4x4 grids; the compiled program's collectives and per-device traffic
against the module's formula; the per-step issue order; the error messages."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err, run_python
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.profiler import COLLECTIVE_KINDS, collective_stats
from jaxpar.parallel.summa import _tree_rounds, communication, reference_matmul, summa_matmul

M, K, N = 8, 12, 16
FORMS = {"nn": (False, False), "nt": (False, True), "tn": (True, False)}


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh(data=2, tensor=(2, 2))  # data=2 replicates the 2x2 grid


def _operands(rng, form, batch=()):
    ta, tb = FORMS[form]
    a = rng.standard_normal((K, M) if ta else (*batch, M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    return a, b


def _loss(matmul, w):
    return lambda a, b: jnp.sum(jnp.sin(matmul(a, b)) * w)


@pytest.mark.parametrize("form", FORMS)
def test_product_and_gradients_match_jnp(mesh, rng, form):
    ta, tb = FORMS[form]
    a, b = _operands(rng, form)
    summa = jax.jit(lambda a, b: summa_matmul(a, b, mesh=mesh, transpose_a=ta, transpose_b=tb))
    ref = lambda a, b: reference_matmul(a, b, transpose_a=ta, transpose_b=tb)
    c = summa(a, b)
    assert c.shape == (M, N)
    assert c.sharding.spec == P("tensor_row", "tensor_col")
    assert rel_err(c, a.T @ b if ta else a @ b.T if tb else a @ b) < 1e-5

    w = rng.standard_normal((M, N)).astype(np.float32)
    grads = jax.jit(jax.grad(_loss(summa, w), argnums=(0, 1)))(a, b)
    expected = jax.jit(jax.grad(_loss(ref, w), argnums=(0, 1)))(a, b)  # one program, not one per op
    for got, want in zip(grads, expected, strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("form", ["nn", "nt"])
def test_batch_dims_of_a_are_folded_into_m(mesh, rng, form):
    a, b = _operands(rng, form, batch=(3,))
    tb = FORMS[form][1]
    ref = lambda a, b: reference_matmul(a, b, transpose_b=tb)
    summa = lambda a, b: summa_matmul(a, b, mesh=mesh, transpose_b=tb)
    # jitted: eagerly, every op of the products and their gradients compiles apart
    assert rel_err(jax.jit(summa)(a, b), jax.jit(ref)(a, b)) < 1e-5
    w = rng.standard_normal((3, M, N)).astype(np.float32)
    grads = jax.jit(jax.grad(_loss(summa, w), argnums=(0, 1)))(a, b)
    for got, want in zip(grads, jax.jit(jax.grad(_loss(ref, w), argnums=(0, 1)))(a, b), strict=True):
        assert rel_err(got, want) < 1e-5


# ----------------------------------------------------------------- the compiled program


def _per_device_traffic(hlo: str) -> tuple[Counter, Counter]:
    """Bytes each device sends and receives over all collective-permutes of ``hlo``."""
    sent, received = Counter(), Counter()
    for shape, pairs in re.findall(
            r"= f32\[([\d,]*)\]\S* collective-permute\(.*?source_target_pairs=\{(.*?)\}\}", hlo):
        nbytes = 4 * int(np.prod([int(d) for d in shape.split(",")]))
        for src, dst in re.findall(r"\{?(\d+),(\d+)", pairs):
            sent[int(src)] += nbytes
            received[int(dst)] += nbytes
    return sent, received


@pytest.mark.parametrize("form", FORMS)
def test_each_step_broadcasts_one_panel_by_tree(mesh, form):
    """Forward and backward are only collective-permutes, q * ceil(log2 q) per moving
    matrix, and every device sends and receives exactly ``communication``'s volume."""
    ta, tb = FORMS[form]
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    a, b = jnp.zeros(a_shape), jnp.zeros(b_shape)
    summa = lambda a, b: summa_matmul(a, b, mesh=mesh, transpose_a=ta, transpose_b=tb)
    grad = jax.grad(lambda a, b: jnp.sum(summa(a, b)), argnums=(0, 1))
    # Forward: two moving matrices; backward: four, less the cotangent broadcast that
    # nt's and tn's two gradient products share.
    for fn, backward, trees in ((summa, False, 2), (grad, True, 4 if form == "nn" else 3)):
        volume = communication(a_shape, b_shape, 2, transpose_a=ta, transpose_b=tb,
                               backward=backward)
        hlo = jax.jit(fn).lower(a, b).compile().as_text()
        stats = collective_stats(hlo)
        assert all(stats["collective_counts"][k] == 0 for k in COLLECTIVE_KINDS
                   if k != "collective-permute"), stats
        assert stats["collective_counts"]["collective-permute"] == trees * 2 * 1  # x q R
        assert stats["collective_bytes"] == 4 * volume["sent"]
        sent, received = _per_device_traffic(hlo)
        assert sorted(sent) == sorted(received) == list(range(8))
        assert set(sent.values()) == set(received.values()) == {4 * volume["sent"]}


def _issue_order(lowered_text: str) -> str:
    """The lowered (pre-optimization) program as a string: C per collective-permute,
    D per block product, in program order."""
    ops = re.findall(r"stablehlo\.(collective_permute|dot_general)", lowered_text)
    return "".join("C" if op == "collective_permute" else "D" for op in ops)


@pytest.mark.parametrize("form", FORMS)
def test_next_panel_is_issued_before_the_current_product(mesh, form):
    # XLA:CPU runs collectives synchronously (no -start/-done pairs to schedule around
    # the dot), so overlap is checked in the program the scheduler receives.
    ta, tb = FORMS[form]
    a = jnp.zeros((K, M) if ta else (M, K))
    b = jnp.zeros((N, K) if tb else (K, N))
    lowered = jax.jit(
        lambda a, b: summa_matmul(a, b, mesh=mesh, transpose_a=ta, transpose_b=tb)).lower(a, b)
    q, rounds = 2, len(_tree_rounds(2))
    if form == "nn":  # both panels, next step's first: C C | C C D | D
        tree = "C" * 2 * rounds
        expected = tree + tree + "D" + "D"
    else:  # one broadcast, then product, then the reduction: C | C D C | D C
        tree = "C" * rounds
        expected = tree + (tree + "D" + tree) + ("D" + tree)
    assert _issue_order(lowered.as_text()) == expected
    assert expected.count("D") == q


@pytest.mark.slow
def test_q4_and_q3_grids_in_subprocess():
    """AB and its gradients on a 4x4 grid (two-round trees); all forms on a 3x3 grid
    (a tree over a count that is not a power of two)."""
    result = run_python("""
        import re
        from collections import Counter
        import jax, jax.numpy as jnp, numpy as np
        import jaxpar
        from jaxpar.parallel.summa import communication, reference_matmul, summa_matmul

        def rel(a, b):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

        rng = np.random.default_rng(0)
        mesh = jaxpar.make_mesh(tensor=(4, 4))
        a = rng.standard_normal((8, 12)).astype(np.float32)
        b = rng.standard_normal((12, 16)).astype(np.float32)
        w = rng.standard_normal((8, 16)).astype(np.float32)
        summa = jax.jit(lambda a, b: summa_matmul(a, b, mesh=mesh))
        assert rel(summa(a, b), a @ b) < 1e-5
        loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)) * w)
        got = jax.jit(jax.grad(loss(summa), argnums=(0, 1)))(a, b)
        want = jax.jit(jax.grad(loss(jnp.matmul), argnums=(0, 1)))(a, b)
        assert max(rel(g, r) for g, r in zip(got, want)) < 1e-5

        hlo = summa.lower(a, b).compile().as_text()
        received = Counter()
        for shape, pairs in re.findall(
                r"= f32\\[([\\d,]*)\\]\\S* collective-permute\\(.*?source_target_pairs=\\{(.*?)\\}\\}", hlo):
            for _, dst in re.findall(r"\\{?(\\d+),(\\d+)", pairs):
                received[int(dst)] += 4 * int(np.prod([int(d) for d in shape.split(",")]))
        assert hlo.count("collective-permute(") == 4 * 2 * 2, hlo.count("collective-permute(")
        assert set(received.values()) == {4 * communication(a.shape, b.shape, 4)["sent"]}
        assert len(received) == 16 and "all-gather" not in hlo and "all-reduce" not in hlo

        mesh = jaxpar.make_mesh(tensor=(3, 3), devices=jax.devices()[:9])
        for ta, tb in ((False, False), (False, True), (True, False)):
            a = rng.standard_normal((9, 6) if ta else (6, 9)).astype(np.float32)
            b = rng.standard_normal((12, 9) if tb else (9, 12)).astype(np.float32)
            c = jax.jit(lambda a, b: summa_matmul(a, b, mesh=mesh, transpose_a=ta, transpose_b=tb))(a, b)
            assert rel(c, reference_matmul(a, b, transpose_a=ta, transpose_b=tb)) < 1e-5
        print("ok")
    """, devices=16)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok" in result.stdout


def test_communication_formula():
    # AB, q=4: (q-1)/q^2 (MK + KN) moved, no partial sums; backward both are reduced.
    assert communication((64, 32), (32, 48), 4) == {"sent": 3 * (64 * 32 + 32 * 48) // 16,
                                                    "partial_sums": 0}
    assert communication((64, 32), (32, 48), 4, backward=True) == {
        "sent": 2 * 3 * (64 * 32 + 32 * 48) // 16, "partial_sums": 3 * (64 * 32 + 32 * 48) // 16}
    assert communication((2, 64, 32), (48, 32), 4, transpose_b=True) == {
        "sent": 3 * (48 * 32 + 2 * 64 * 48) // 16, "partial_sums": 3 * 2 * 64 * 48 // 16}
    assert communication((32, 64), (32, 48), 2, transpose_a=True) == {
        "sent": (32 * 64 + 64 * 48) // 4, "partial_sums": 64 * 48 // 4}
    assert communication((32, 64), (32, 48), 2, transpose_a=True, backward=True) == {
        "sent": (2 * 32 * 64 + 64 * 48) // 4, "partial_sums": 32 * 64 // 4}


def test_bfloat16_accumulates_and_reduces_in_float32(mesh, rng):
    """bf16 operands: the product and both gradients (the weight gradient summed over
    the data-parallel replicas too) are the float32 results on the same bf16 values,
    rounded to bf16 once: within half a bf16 ulp of them, which partial sums rounded
    to bf16 on the way exceed. The reduced partial sums travel as float32."""
    bf16 = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    a, b, w = bf16((64, 48)), bf16((48, 32)), bf16((64, 32))
    fn = lambda a, b: summa_matmul(a, b, mesh=mesh, batch_axes=("data",))  # noqa: E731
    c = jax.jit(fn)(a, b)
    # d/dC of sum(C * w) is w exactly, so dA = w Bᵀ (nt) and dB = Aᵀ w (tn, then a psum).
    da, db = jax.jit(jax.grad(lambda a, b: jnp.sum((fn(a, b) * w).astype(jnp.float32)),
                              argnums=(0, 1)))(a, b)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    for got, want in ((c, f32(a) @ f32(b)), (da, f32(w) @ f32(b).T), (db, f32(a).T @ f32(w))):
        assert got.dtype == jnp.bfloat16
        bound = 2.0**-8 * np.abs(want) + 1e-6 * np.abs(want).max()  # half an ulp, f32 slack
        assert np.all(np.abs(f32(got) - want) <= bound), np.max(np.abs(f32(got) - want) / bound)

    # In the lowered program (XLA:CPU's compiler then widens every bf16 collective to
    # f32, having no bf16 dot): AB^T's B panels [N/q, K/q] move as bf16, the partial
    # sums of C [M/q, N/q] as f32, one tree round per step.
    lowered = jax.jit(lambda x, y: summa_matmul(x, y, mesh=mesh, transpose_b=True)).lower(
        bf16((M, K)), bf16((N, K))).as_text()
    moved = Counter(re.findall(r"collective_permute.*?-> tensor<([^>]*)>", lowered))
    assert moved == {f"{N // 2}x{K // 2}xbf16": 2, f"{M // 2}x{N // 2}xf32": 2}, moved


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("a_shape,b_shape,kwargs,match", [
    ((9, 12), (12, 16), {}, r"M=9 \(a\.shape\[-2\]\) is not divisible by the grid size q=2"),
    ((8, 12), (12, 15), {}, r"N=15 \(b\.shape\[1\]\) is not divisible"),
    ((8, 12), (10, 16), {}, r"contraction dimension K differs: a\.shape\[-1\]=12 but b\.shape\[0\]=10"),
    ((12, 8), (10, 16), {"transpose_a": True}, r"a\.shape\[0\]=12 but b\.shape\[0\]=10"),
    ((8, 12), (16, 10), {"transpose_b": True}, r"a\.shape\[-1\]=12 but b\.shape\[1\]=10"),
    ((8, 12), (16, 12), {"transpose_a": True, "transpose_b": True}, "together are not supported"),
    ((3, 12, 8), (12, 16), {"transpose_a": True}, "transpose_a takes no batch dimensions"),
    ((8, 12), (1, 12, 16), {}, r"b must be \[K, N\]"),
    ((8, 12), (12, 16), {"row_axis": "tensor"}, "row_axis='tensor' is not an axis of the mesh"),
    ((8, 12), (12, 16), {"col_axis": "tensor_row"}, "both 'tensor_row'"),
])
def test_errors_name_the_offending_dimension(mesh, a_shape, b_shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        summa_matmul(jnp.zeros(a_shape), jnp.zeros(b_shape), mesh=mesh, **kwargs)


def test_errors_on_meshes_without_a_square_grid():
    a, b = jnp.zeros((8, 8)), jnp.zeros((8, 8))
    with pytest.raises(ValueError, match="row_axis='tensor_row' is not an axis"):
        summa_matmul(a, b, mesh=jaxpar.make_mesh(data=8))
    rect = jax.make_mesh((2, 4), ("tensor_row", "tensor_col"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="tensor_row=2 x tensor_col=4 is not square"):
        summa_matmul(a, b, mesh=rect)


def test_batch_axes_split_rows_with_data_parallelism(rng):
    """Each data-parallel replica runs its own SUMMA; gradients sum over replicas."""
    mesh = jaxpar.make_mesh(data=2, tensor=(2, 2))
    a = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
    for tb, bb in ((False, b), (True, b.T)):
        fn = lambda a, b: summa_matmul(a, b, mesh=mesh, transpose_b=tb, batch_axes=("data",))  # noqa: E731
        ref = lambda a, b: reference_matmul(a, b, transpose_b=tb)  # noqa: E731
        assert rel_err(jax.jit(fn)(a, bb), ref(a, bb)) < 1e-5
        loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
        got = jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(a, bb)
        want = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(a, bb)
        assert all(rel_err(g, w) < 1e-5 for g, w in zip(got, want))
    with pytest.raises(ValueError, match="batch_axes=\\('data',\\) need a 2D a"):
        summa_matmul(a, b, mesh=mesh, transpose_a=True, batch_axes=("data",))
    with pytest.raises(ValueError, match="M=6 .* not divisible by the 4 ways"):
        summa_matmul(a[:6], b, mesh=mesh, batch_axes=("data",))
