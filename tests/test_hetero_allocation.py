"""Sky Computing's allocation of layers to pipeline ranks of unequal speed and memory
(jaxpar.hetero.allocation) against brute force and hand-computed cases."""

import itertools

import numpy as np
import pytest

from jaxpar.hetero import allocate, even_split, stage_times


def compositions(layers: int, ranks: int):
    """Every split of ``layers`` into ``ranks`` positive parts, in order."""
    for cuts in itertools.combinations(range(1, layers), ranks - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute_force(costs, speeds, memories, layer_memory, fixed, fixed_costs=None):
    """The least slowest-stage time over every split that fits, or inf."""
    best = np.inf
    for split in compositions(len(costs), len(speeds)):
        bounds = np.concatenate([[0], np.cumsum(split)])
        used = [sum(layer_memory[a:b]) + f for a, b, f in zip(bounds, bounds[1:], fixed)]
        if all(u <= m for u, m in zip(used, memories)):
            best = min(best, stage_times(split, costs, speeds, fixed_costs).max())
    return best


@pytest.mark.parametrize("seed", range(40))
def test_allocation_equals_brute_force(seed):
    """Random layer costs, speeds, memories and per-layer memory (a fifth of the cases
    fitting nowhere): the allocation's slowest stage is brute force's least, and it fits."""
    rng = np.random.default_rng(seed)
    L, R = int(rng.integers(3, 10)), int(rng.integers(1, 5))
    R = min(R, L)
    costs = rng.uniform(0.5, 2.0, L)
    speeds = rng.uniform(0.5, 2.0, R)
    layer_memory = rng.uniform(1.0, 3.0, L)
    fixed = rng.uniform(0.0, 1.0, R)
    memories = rng.uniform(0.6, 1.6, R) * layer_memory.sum() / R + fixed
    want = brute_force(costs, speeds, memories, layer_memory, fixed)
    if not np.isfinite(want):
        with pytest.raises(ValueError, match=f"no split of {L} layers over {R} pipeline ranks fits"):
            allocate(costs, speeds, memories, layer_memory, fixed)
        return
    split = allocate(costs, speeds, memories, layer_memory, fixed)
    assert sum(split) == L and len(split) == R and min(split) >= 1
    assert stage_times(split, costs, speeds).max() == pytest.approx(want, rel=1e-12)
    bounds = np.concatenate([[0], np.cumsum(split)])
    assert all(sum(layer_memory[a:b]) + f <= m for a, b, f, m in zip(bounds, bounds[1:], fixed, memories))


@pytest.mark.parametrize("seed", range(20))
def test_fixed_costs_equal_brute_force(seed):
    """A fixed time per rank (the last rank's head): still brute force's least."""
    rng = np.random.default_rng(200 + seed)
    L, R = int(rng.integers(3, 10)), int(rng.integers(1, 5))
    R = min(R, L)
    costs, speeds = rng.uniform(0.5, 2.0, L), rng.uniform(0.5, 2.0, R)
    fixed_costs = np.where(rng.uniform(size=R) < 0.5, rng.uniform(0.0, 3.0, R), 0.0)
    want = brute_force(costs, speeds, [np.inf] * R, [0.0] * L, [0.0] * R, fixed_costs)
    split = allocate(costs, speeds, fixed_costs=fixed_costs)
    assert stage_times(split, costs, speeds, fixed_costs).max() == pytest.approx(want, rel=1e-12)


def test_hand_computed_cases():
    # equal devices: the even split, later stages one more where it does not divide
    assert allocate([1.0] * 12, [1.0] * 4) == even_split(12, 4) == (3, 3, 3, 3)
    assert allocate([1.0] * 10, [1.0] * 4) == even_split(10, 4) == (2, 2, 3, 3)
    # a rank twice as fast takes twice the layers: 12 layers at speeds 2, 1, 1 -> 6, 3, 3 (3 time units each)
    assert allocate([1.0] * 12, [2.0, 1.0, 1.0]) == (6, 3, 3)
    # ... unless its memory holds only 4: then 4, 4, 4 (4 time units)
    assert allocate([1.0] * 12, [2.0, 1.0, 1.0], memories=[4, 100, 100], layer_memory=[1.0] * 12) == (4, 4, 4)
    # the paper's shape of gain: speeds 2 and 1 over 30 layers, 20 and 10 (10 units) against 15 and 15 (15 units)
    split = allocate([1.0] * 30, [2.0, 1.0])
    assert split == (20, 10)
    even = stage_times(even_split(30, 2), [1.0] * 30, [2.0, 1.0]).max()
    assert even / stage_times(split, [1.0] * 30, [2.0, 1.0]).max() == pytest.approx(1.5)
    # a head worth 3 layers on the last of 3 equal ranks: 5, 5, 2 (5 units each)
    assert allocate([1.0] * 12, [1.0] * 3, fixed_costs=[0, 0, 3]) == (5, 5, 2)


@pytest.mark.parametrize("seed", range(10))
def test_never_slower_than_even(seed):
    rng = np.random.default_rng(100 + seed)
    L, R = int(rng.integers(8, 40)), int(rng.integers(2, 8))
    costs, speeds = rng.uniform(0.5, 2.0, L), rng.choice([1.0, 2.0], R)
    split = allocate(costs, speeds)
    assert stage_times(split, costs, speeds).max() <= stage_times(even_split(L, R), costs, speeds).max()


@pytest.mark.parametrize("args,message", [
    (([1.0] * 3, [1.0] * 4), "3 layers cannot make 4 stages"),
    (([1.0] * 4, [1.0, 0.0]), "speeds must all be positive, got 0.0"),
    (([1.0] * 4, [1.0, 1.0], [1.0]), "memories has 1 entries for 2 ranks"),
    (([1.0] * 4, [1.0, 1.0], None, None, None, [0.0, -1.0]), "fixed_costs must all be non-negative, got -1.0"),
    (([1.0] * 4, [1.0, 1.0], [1.0, 1.0], [1.0] * 4), r"no split of 4 layers over 2 pipeline ranks fits"),
])
def test_bad_input_is_one_line(args, message):
    with pytest.raises(ValueError, match=message) as error:
        allocate(*args)
    assert "\n" not in str(error.value)
