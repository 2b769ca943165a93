"""The grouped-matmul kernel (``jaxpar.kernels.grouped_matmul``, Pallas interpret mode)
against its reference (``jax.lax.ragged_dot``), forward and both gradients, and the
forward against a float64 loop over the groups. The groups are chosen to hit every case
the kernel's schedule has: empty groups (first, in the middle and last), a group inside
one row tile, groups straddling tiles (a tile holding parts of three groups), and rows
past the groups' total (zeros out, zero input gradient); K and N not powers of two nor
multiples of the tiles. One compiled program (forward and backward) for the kernel, one
for the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxpar import use_execution
from jaxpar.kernels import KernelOptions, grouped_matmul, grouped_matmul_reference
from jaxpar.models.moe import expert_mlp

# 8 groups over 50 rows, 44 of them grouped; tiles of 16 rows: tile 0 holds groups 1, 2
# and 3 (rows 0-4, 5-6, 7-15...), group 3 runs on into tile 1, group 6 straddles 2 and 3.
GROUP_SIZES = np.asarray([0, 5, 2, 20, 0, 3, 14, 0], np.int32)
M, K, N = 50, 24, 40
TILES = dict(block_m=16, block_k=16, block_n=32)


def naive(lhs, rhs, group_sizes):
    """float64: each group's rows times its matrix, zeros past the total."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
    for g, size in enumerate(group_sizes):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


def test_kernel_and_its_gradients_equal_the_reference(rng):
    lhs, rhs, cot = (jax.device_put(rng.standard_normal(s).astype(np.float32))
                     for s in ((M, K), (len(GROUP_SIZES), K, N), (M, N)))
    sizes = jax.device_put(GROUP_SIZES)

    @jax.jit
    def both(lhs, rhs, sizes, cot):
        kernel = lambda a, b: grouped_matmul(a, b, sizes, **TILES, interpret=True)  # noqa: E731
        reference = lambda a, b: grouped_matmul_reference(a, b, sizes)  # noqa: E731
        runs = []
        for fn in (kernel, reference):
            out, pull = jax.vjp(fn, lhs, rhs)
            runs.append((out, *pull(cot)))
        return runs

    (out, d_lhs, d_rhs), (want, want_lhs, want_rhs) = both(lhs, rhs, sizes, cot)
    total = int(GROUP_SIZES.sum())
    assert rel_err(want, naive(lhs, rhs, GROUP_SIZES)) < 1e-5
    assert rel_err(out, want) < 1e-5 and rel_err(d_lhs, want_lhs) < 1e-5 and rel_err(d_rhs, want_rhs) < 1e-5
    assert not np.asarray(out[total:]).any() and not np.asarray(d_lhs[total:]).any()
    assert not np.asarray(d_rhs[GROUP_SIZES == 0]).any() and np.asarray(d_rhs[GROUP_SIZES > 0]).all()


def test_the_expert_mlp_runs_the_kernel_when_execution_moe_says_so(rng):
    """Traced, not run: ``execution.moe=pallas`` puts the kernel (three grouped matmuls)
    in the expert MLP's program, ``xla`` and ``auto`` on CPU ``ragged_dot``."""
    E, D, F, rows = 4, 8, 16, 12
    xs, up, gate, down = (rng.standard_normal(s).astype(np.float32) for s in ((rows, D), (E, D, F), (E, D, F),
                                                                               (E, F, D)))
    sizes = np.asarray([3, 0, 5, 2], np.int32)
    for choice, want in (("pallas", "pallas_call"), ("xla", "ragged_dot"), ("auto", "ragged_dot")):
        with use_execution(kernels=KernelOptions(moe=choice)):
            # a new function each time: JAX's tracing cache does not see the execution
            text = str(jax.make_jaxpr(lambda *a: expert_mlp(*a))(xs, sizes, gate, up, down))
        assert text.count(want) >= 3 and ("pallas_call" in text) == (choice == "pallas"), choice


def test_bad_shapes_and_tiles_are_refused():
    lhs, rhs, sizes = np.ones((4, 8), np.float32), np.ones((2, 8, 16), np.float32), np.asarray([1, 3], np.int32)
    with pytest.raises(ValueError, match=r"block_m=24 must be a power of two >= 16"):
        grouped_matmul(lhs, rhs, sizes, block_m=24, interpret=True)
    with pytest.raises(ValueError, match=r"got lhs \(4, 8\), rhs \(2, 6, 16\)"):
        grouped_matmul(lhs, rhs[:, :6], sizes, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes \(2,\) float32"):
        grouped_matmul(lhs, rhs, sizes.astype(np.float32), interpret=True)
