import jax
import pytest

import jaxpar
from conftest import run_python


def test_axes_and_order():
    mesh = jaxpar.make_mesh(data=2, fsdp=4)
    assert mesh.axis_names == ("data", "fsdp", "pipe", "seq", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "pipe": 1, "seq": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_an_expert_axis_sits_after_fsdp_only_when_asked_for():
    mesh = jaxpar.make_mesh(data=2, fsdp=2, expert=2)
    assert mesh.axis_names == ("data", "fsdp", "expert", "pipe", "seq", "tensor")
    assert [[d.id for d in row] for row in mesh.devices.reshape(4, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert jaxpar.make_mesh(data=8, expert=1).axis_names == ("data", "fsdp", "pipe", "seq", "tensor")
    with pytest.raises(ValueError, match=r"^mesh axis expert=0 must be a positive int$"):
        jaxpar.make_mesh(data=8, expert=0)


def test_innermost_axis_holds_neighbouring_devices():
    mesh = jaxpar.make_mesh(data=2, tensor=4)
    ids = [[d.id for d in row] for row in mesh.devices.reshape(2, 4)]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_explicit_devices():
    mesh = jaxpar.make_mesh(fsdp=4, devices=jax.devices()[4:])
    assert sorted(d.id for d in mesh.devices.flat) == [4, 5, 6, 7]


@pytest.mark.parametrize("sizes", [dict(fsdp=4), dict(data=3, fsdp=3), dict(data=16)])
def test_wrong_product_names_sizes_and_count(sizes):
    with pytest.raises(ValueError, match=r"multiply to \d+, but there are 8 devices"):
        jaxpar.make_mesh(**sizes)


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2", True])
def test_bad_size(bad):
    with pytest.raises(ValueError, match="mesh axis fsdp=.* must be a positive int"):
        jaxpar.make_mesh(fsdp=bad)


def test_sixteen_devices_in_a_subprocess():
    out = run_python(
        """
        import jaxpar
        mesh = jaxpar.make_mesh(data=2, fsdp=8)
        print(mesh.devices.size, dict(mesh.shape)["fsdp"])
        """,
        devices=16,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["16", "8"]


def test_two_dimensional_tensor_grid():
    mesh = jaxpar.make_mesh(data=2, tensor=(2, 2))
    assert mesh.axis_names == ("data", "fsdp", "pipe", "seq", "tensor_row", "tensor_col")
    assert dict(mesh.shape)["tensor_row"] == dict(mesh.shape)["tensor_col"] == 2


@pytest.mark.parametrize("grid", [(2, 4), (1, 1), (2,), (2, 2, 2)])
def test_non_square_grid(grid):
    with pytest.raises(ValueError, match=r"a 2D tensor grid must be square, \(q, q\) with q >= 2"):
        jaxpar.make_mesh(tensor=grid)


def test_explicit_axis_types():
    mesh = jaxpar.make_mesh(data=2, fsdp=4, axis_types="explicit")
    assert mesh.axis_names == jaxpar.make_mesh(data=2, fsdp=4).axis_names
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    grid = jaxpar.make_mesh(data=2, tensor=(2, 2), axis_types="explicit")
    assert all(t == jax.sharding.AxisType.Explicit for t in grid.axis_types)


@pytest.mark.parametrize("bad", ["Explicit", "manual", None, ["auto"]])
def test_bad_axis_types(bad):
    with pytest.raises(ValueError, match=r"^mesh axis_types=.* must be one of \['auto', 'explicit'\]$"):
        jaxpar.make_mesh(fsdp=8, axis_types=bad)
