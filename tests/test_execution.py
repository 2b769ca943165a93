"""The Execution (rules, kernel and sequence options) is part of every jitted entry
point's cache key: a function called under two settings runs two programs, each right."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import Execution, SequenceOptions, use_execution
from jaxpar.kernels import KernelOptions
from jaxpar.parallel.zigzag import from_zigzag, to_zigzag
from jaxpar.placement.execution import current

from conftest import rel_err


@pytest.mark.slow
def test_same_function_under_two_sequence_layouts_gives_both_results(rng):
    """Causal attention over a length split 4 ways, in natural and in zigzag token order:
    a program traced for one order and reused for the other would be wrong."""
    q, k, v = (rng.standard_normal((2, 16, 2, 8)).astype(np.float32) for _ in range(3))
    zigzag_inputs = [jnp.asarray(to_zigzag(x, 4)) for x in (q, k, v)]  # alike in all but order
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    reference = jaxpar.dot_product_attention(q, k, v, causal=True)  # no mesh: plain attention
    attend = jaxpar.jit(lambda q, k, v: jaxpar.dot_product_attention(q, k, v, causal=True))
    with jaxpar.use_mesh(jaxpar.make_mesh(data=2, seq=4)):
        natural = attend(q, k, v)
        with use_execution(sequence=SequenceOptions(layout="zigzag")):
            zigzag = attend(*zigzag_inputs)
    assert rel_err(natural, reference) < 1e-5
    assert rel_err(from_zigzag(zigzag, 4), reference) < 1e-5


def test_kernel_options_retrace():
    seen = []

    @jaxpar.jit
    def double(x):
        seen.append(current().kernels.attention)
        return 2 * x

    x = jnp.arange(4.0)
    double(x)
    with use_execution(kernels=KernelOptions(attention="pallas")):
        double(x)
        double(x)  # cached for this setting
    double(x)
    assert seen == ["auto", "pallas"]


def test_execution_is_hashable_and_validates_rules():
    a = Execution(rules=[("batch", ["data", "fsdp"])])
    assert a == Execution(rules=(("batch", ("data", "fsdp")),)) and hash(a) == hash(Execution(rules=a.rules))
    with pytest.raises(ValueError, match="more than one sharding rule"):
        Execution(rules=[("batch", "data"), ("batch", None)])


def test_mesh_without_rules_is_an_error():
    mesh = jaxpar.make_mesh(fsdp=8)
    x = jnp.ones((8, 4))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="no sharding rules"):
        jax.jit(lambda x: jaxpar.constrain(x, ("activation_batch", None)))(x)
    with jaxpar.use_mesh(mesh):  # with rules: the batch split over fsdp
        y = jax.jit(lambda x: jaxpar.constrain(x, ("activation_batch", None)))(x)
    assert y.sharding.spec[0] == "fsdp"
