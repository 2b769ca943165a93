"""jaxpar.planning.calibrate: the measured ``cpu`` profile on the 8 simulated devices
(tests/conftest.py) is complete and plausible, round-trips through its YAML, and its
peak predicts a matmul it was not measured on."""

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.planning import hardware
from jaxpar.planning.calibrate import calibrate, calibrate_and_save


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    hw, path = calibrate_and_save(cache_dir)
    return hw, path, cache_dir


def _figures(hw):
    return {**{f"peak_flops.{k}": v for k, v in hw.peak_flops.items()},
            **{f"efficiency.{k}": v for k, v in hw.efficiency.items()},
            **{k: getattr(hw, k) for k in ("hbm_bandwidth", "memory", "intra_node_bandwidth",
                                          "inter_node_bandwidth", "collective_latency",
                                          "host_bandwidth")}}


def test_every_field_positive_and_finite(saved):
    hw, _, _ = saved
    assert hw.name == "cpu"
    assert set(hw.peak_flops) == {"float32", "bfloat16"}
    for key, value in _figures(hw).items():
        assert math.isfinite(value) and value > 0, (key, value)
    assert hw.efficiency["matmul"] == 1.0
    assert 0 < hw.efficiency["attention"] <= 1
    assert hw.intra_node_bandwidth == hw.inter_node_bandwidth
    assert hw.comm_overlap == 0.0
    assert hw.collective_latency < 0.1  # a 4-float psum, not a stuck rendezvous


def test_saved_profile_loads_back(saved):
    hw, path, cache_dir = saved
    assert path == hardware.calibrated_path(cache_dir)
    assert hardware.load("cpu", cache_dir) == hw
    notes = yaml.safe_load(path.read_text())["notes"]
    assert f"{len(jax.devices())} simulated XLA:CPU devices" in notes and jax.__version__ in notes


def test_peak_predicts_another_matmul(saved):
    """A sharded matmul of shapes the calibration did not use takes flops / peak within a
    factor of 3 (median of runs)."""
    hw, _, _ = saved
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))
    b, m, k, o = 2, 384, 768, 640
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((n * b, m, k), np.float32), sharding)
    w = jax.device_put(rng.standard_normal((n * b, k, o), np.float32), sharding)
    f = jax.jit(lambda x, w: jnp.einsum("bmk,bko->bmo", x, w))
    f(x, w).block_until_ready()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        f(x, w).block_until_ready()
        times.append(time.perf_counter() - start)
    measured = statistics.median(times)
    predicted = 2 * b * m * k * o / hw.peak("float32")
    assert 1 / 3 < predicted / measured < 3, (predicted, measured)


def test_one_device_uses_hbm_bandwidth_for_links():
    hw = calibrate(1, seconds=0.3)
    assert hw.intra_node_bandwidth == hw.inter_node_bandwidth == hw.hbm_bandwidth
    assert all(math.isfinite(v) and v > 0 for v in _figures(hw).values())


@pytest.mark.parametrize("devices", [0, len(jax.devices()) + 1, True])
def test_bad_device_count(devices):
    with pytest.raises(ValueError, match="devices="):
        calibrate(devices)
