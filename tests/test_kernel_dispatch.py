"""Who runs attention, norms and the loss, as a function of the device and the shapes,
without a GPU: ``jaxpar.kernels.dispatch.choose`` is pure, and the device it reads
(``dispatch.device``) is replaced by a T4's or an H100's to lower for CUDA."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import kernels
from jaxpar.kernels import dispatch
from jaxpar.kernels.dispatch import KernelOptions, choose

T4, A100, H100 = (7, 5), (8, 0), (9, 0)


@pytest.mark.parametrize("backend,capability,expected", [
    ("cpu", None, "xla"),
    ("tpu", None, "xla"),
    ("gpu", T4, "xla"),      # Colab's free GPU: Triton needs 8.0 (jax-ml/jax#26799)
    ("gpu", (6, 1), "xla"),
    ("gpu", A100, "pallas"),
    ("gpu", H100, "pallas"),
    ("gpu", (12, 0), "pallas"),
    ("gpu", None, "pallas"),  # ROCm: no CUDA capability, the kernels as before
])
def test_auto_picks_pallas_only_on_a_gpu_that_runs_it(backend, capability, expected):
    for op in ("attention", "norm", "loss", "kernels"):
        impl, reason = choose(op, "auto", backend, capability)
        assert impl == expected
        if backend == "gpu" and expected == "xla":
            assert reason == (f"this GPU has compute capability {capability[0]}.{capability[1]} and "
                              "Pallas' Triton kernels need 8.0 or newer (jax-ml/jax#26799)")
        else:
            assert reason is None


def test_the_moe_exchange_is_ragged_where_the_backend_has_a_ragged_all_to_all():
    """``execution.moe_exchange``: auto is the padded buffers on a CPU (XLA:CPU has no
    ``ragged_all_to_all``) and ragged on a GPU (any capability: a collective, not a
    Pallas kernel) or TPU; ragged asked for on a CPU is one line, from the config too."""
    from jaxpar.train.config import ConfigError, load_config

    assert choose("moe_exchange", "auto", "cpu", None) == ("padded", None)
    for backend, capability in (("gpu", T4), ("gpu", H100), ("tpu", None)):
        assert choose("moe_exchange", "auto", backend, capability) == ("ragged", None)
        assert choose("moe_exchange", "padded", backend, capability) == ("padded", None)
    message = ("execution.moe_exchange='ragged' needs a GPU or TPU: XLA:CPU has no jax.lax.ragged_all_to_all; "
               "use execution.moe_exchange=auto or padded")
    with pytest.raises(ValueError) as e:
        choose("moe_exchange", "ragged", "cpu", None)
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:
        load_config("moe_tiny", ["execution.moe_exchange=ragged"]).execution.kernels
    assert str(e.value) == message


@pytest.mark.parametrize("capability", [A100, H100])
def test_explicit_choices_run_as_asked_on_a_capable_gpu(capability):
    for choice in ("xla", "pallas", "cudnn"):
        assert choose("attention", choice, "gpu", capability) == (choice, None)
    assert choose("norm", "pallas", "cpu", None) == ("pallas", None)  # interpret mode


def test_explicit_kernels_on_an_older_gpu_are_one_line_errors():
    with pytest.raises(ValueError) as e:
        choose("attention", "pallas", "gpu", T4)
    assert str(e.value) == ("execution.attention='pallas' needs a GPU of compute capability 8.0 or newer "
                            "(Pallas' Triton lowering, jax-ml/jax#26799); this one has 7.5: use "
                            "execution.attention=auto or xla")
    with pytest.raises(ValueError, match=r"^execution.attention='cudnn' needs a GPU of compute capability "
                                         r"8.0 or newer \(cuDNN's fused attention\); this one has 7.5"):
        choose("attention", "cudnn", "gpu", T4)
    with pytest.raises(ValueError, match=r"^execution.loss='pallas' needs .* this one has 6.1: use "
                                         r"execution.loss=auto or xla$"):
        choose("loss", "pallas", "gpu", (6, 1))
    assert choose("attention", "xla", "gpu", T4) == ("xla", None)
    with pytest.raises(ValueError, match="execution.attention='cudnn' needs a GPU; JAX's backend here is 'cpu'"):
        choose("attention", "cudnn", "cpu", None)


def test_an_unknown_choice_names_its_config_key():
    """The key a user sets (jaxpar-train's ``execution.norm``), not a renamed one."""
    with pytest.raises(ValueError, match=r"^execution.norm='fused' must be one of \['auto', 'xla', 'pallas'\]$"):
        KernelOptions(norm="fused")


@pytest.fixture
def simulated(monkeypatch, caplog):
    """``simulated(capability)`` makes dispatch see a CUDA GPU of that capability; the
    once-per-reason log starts empty."""
    monkeypatch.setattr(dispatch, "_REPORTED", set())
    caplog.set_level(logging.WARNING, logger="jaxpar.kernels")
    return lambda capability: monkeypatch.setattr(dispatch, "device", lambda: ("gpu", capability))


def test_options_on_a_t4_fall_back_once_and_refuse_pallas(simulated, caplog):
    simulated(T4)
    options = KernelOptions()
    assert [options.resolve(op) for op in ("attention", "norm", "loss", "attention")] == ["xla"] * 4
    assert caplog.text.count("compute capability 7.5") == 1
    assert "running the XLA reference instead" in caplog.text
    with pytest.raises(ValueError, match="execution.norm='pallas' needs a GPU of compute capability 8.0"):
        KernelOptions(norm="pallas")
    simulated(H100)
    assert KernelOptions().resolve("attention") == "pallas" and KernelOptions(norm="pallas").norm == "pallas"


def lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("capability,new_tokens,kernel", [
    (H100, 4, True),
    (A100, 4, True),
    (T4, 4, False),     # too old: XLA's reference, whatever the shape
    (H100, 40, False),  # the tree mask's bits hold 32 new tokens: the reference
    (T4, 40, False),
])
def test_kernel_entry_points_by_capability_and_shape(simulated, rng, capability, new_tokens, kernel):
    """``interpret=None`` (the default) lowered for CUDA: a Triton call exactly where the
    device and the shape allow one."""
    simulated(capability)
    B, S, N, K, H = 1, 64, 2, 1, 64
    q = jnp.asarray(rng.standard_normal((B, new_tokens, N, H)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16) for _ in range(2))
    lengths = jnp.asarray([50], jnp.int32)
    text = lowered_for_cuda(lambda q, k, v: kernels.decode_attention(q, k, v, lengths), q, k, v)
    assert ("triton" in text) == kernel
    x, scale = jnp.asarray(rng.standard_normal((8, 96)), jnp.float32), jnp.ones((96,), jnp.float32)
    assert ("triton" in lowered_for_cuda(lambda x: kernels.rms_norm(x, scale), x)) == (capability >= A100)
