"""Sequence parallelism (jaxpar.ring_attention) against plain attention on one device."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from conftest import rel_err, train_steps, tree_rel_err
from jaxpar.parallel import sequence as sp
from jaxpar import use_execution
from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.models import ModelConfig
from jaxpar import SequenceOptions
from jaxpar.parallel.sequence import ring_attention
from jaxpar.parallel.zigzag import from_zigzag, to_zigzag


def seq_mesh(n, **others):
    sizes = dict(seq=n, **others)
    count = int(np.prod([np.prod(v) for v in sizes.values()]))
    return jaxpar.make_mesh(**sizes, devices=jax.devices()[:count])


def inputs(rng, B=2, T=64, N=8, K=2, H=64, documents=3):
    """Fresh random q, k, v, output cotangent, and sorted segment ids (several documents)."""
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    segments = jnp.asarray(np.sort(rng.integers(0, documents, (B, T)), axis=1), jnp.int32)
    return normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H), normal(B, T, N, H), segments


@functools.partial(jaxpar.jit, static_argnums=5)
def reference(q, k, v, g, seg, causal):
    """Plain attention on one device: its output and q/k/v gradients for the cotangent
    ``g``. One compiled program per shape, shared by the tests (eagerly, every op of the
    forward and backward compiled apart for each new shape); ``jaxpar.jit``, so a test
    under other kernel options (the flash kernel's) gets its own."""
    out, vjp = jax.vjp(lambda q, k, v: jaxpar.dot_product_attention(q, k, v, causal=causal, segment_ids=seg),
                       q, k, v)
    return out, vjp(g)


def check_against_reference(q, k, v, g, seg, mesh, *, causal, impl, layout, n, tol=1e-5, want=None):
    """ring_attention's output and q/k/v gradients equal plain attention's (one device):
    ``want``, ``reference(...)``'s output and gradients, when given (computed under
    other kernel options), else computed here."""
    out_ref, grads_ref = reference(q, k, v, g, seg, causal) if want is None else want
    # reordered on the host (numpy): eagerly on device, each take compiles per shape
    z = (lambda x: None if x is None else to_zigzag(np.asarray(x), n)) if layout == "zigzag" else (lambda x: x)

    @jax.jit  # forward and backward in one program (jax.vjp of a jitted function compiles two)
    def parallel(q, k, v, g, seg):
        out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=seg,
                                                          impl=impl, layout=layout), q, k, v)
        return out, vjp(g)

    out, grads = parallel(z(q), z(k), z(v), z(g), z(seg))
    assert rel_err(out, z(out_ref)) < tol
    for name, got, want in zip("qkv", grads, grads_ref):
        assert rel_err(got, z(want)) < tol, name


# N = 2, 4, 8, causal and not, both layouts (not every product: compile time).
# (8, True, "natural", 64) is not among them: the causal natural ring is (2, True, "natural"),
# eight devices' rings (8, True, "zigzag") and (8, False, "zigzag"), the same checks. Nor is
# head_dim 128, (4, True, "zigzag", 128) and (4, False, "natural", 128): nothing in the ring
# depends on the head dimension but its 1/sqrt(H) scale (test_ring_on_the_flash_kernel's
# rings run head_dim 16).
RING_CASES = [(2, True, "natural", 64), (2, False, "zigzag", 64), (4, True, "zigzag", 64),
              (4, False, "natural", 64), (8, True, "zigzag", 64),
              (8, False, "zigzag", 64)]


@pytest.mark.slow
@pytest.mark.parametrize("n,causal,layout,H", RING_CASES)
def test_ring_matches_full_attention(rng, n, causal, layout, H):
    q, k, v, g, seg = inputs(rng, H=H)
    check_against_reference(q, k, v, g, seg, seq_mesh(n), causal=causal, impl="ring", layout=layout, n=n)


@pytest.mark.slow
@pytest.mark.parametrize("impl,n,causal,layout", [
    ("rsa", 2, True, "natural"), ("rsa", 8, True, "zigzag"), ("rsa", 4, False, "natural"),
    ("ulysses", 4, True, "zigzag"), ("ulysses", 4, False, "natural"),
    # 2 kv heads over 8 devices: each query head gets its own copy (and causal natural
    # Ulysses, which ("ulysses", 2, True, "natural") checked the same, on 2 devices)
    ("ulysses", 8, True, "natural"),
])
def test_rsa_and_ulysses_match_full_attention(rng, impl, n, causal, layout):
    q, k, v, g, seg = inputs(rng)
    check_against_reference(q, k, v, g, seg, seq_mesh(n), causal=causal, impl=impl, layout=layout, n=n)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_inner_key_blocks(rng, monkeypatch, impl):
    """Local key blocks longer than KV_BLOCK are walked in a loop, forward and backward."""
    monkeypatch.setattr(sp, "KV_BLOCK", 8)
    q, k, v, g, seg = inputs(rng, T=128, N=4, K=4, H=16)
    check_against_reference(q, k, v, g, seg, seq_mesh(2), causal=True, impl=impl, layout="natural", n=2)


@pytest.mark.slow
def test_no_segments_and_multi_query(rng):
    q, k, v, g, _ = inputs(rng, N=4, K=1)
    for causal in (True, False):
        check_against_reference(q, k, v, g, None, seq_mesh(4), causal=causal, impl="ring",
                                layout="zigzag", n=4)


@pytest.mark.slow
# (fsdp=2, tensor=2) is not among them: data and fsdp are both the rules' activation_batch
# axes, which ring_attention splits the batch over alike (data=2, tensor=2 checks it).
@pytest.mark.parametrize("others", [dict(data=2, tensor=2), dict(tensor=4)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_other_axes_split_batch_and_heads(rng, others):
    """Batch over the batch axes (data) and heads over tensor; with tensor=4 and 2 kv
    heads the kv heads stay whole and each device picks the ones its query heads read."""
    q, k, v, g, seg = inputs(rng, B=4)
    check_against_reference(q, k, v, g, seg, seq_mesh(2, **others), causal=True, impl="ring",
                            layout="zigzag", n=2)


@pytest.mark.slow
@pytest.mark.parametrize("n,causal,layout", [(2, True, "zigzag"), (4, False, "natural")])
def test_ring_on_the_flash_kernel(rng, n, causal, layout):
    """execution.attention=pallas: the ring's inner steps run the Pallas flash kernel's
    block_update / block_grads (interpret mode), with the rings' token positions. The
    reference is plain attention's XLA code on one device, computed outside the kernel
    options (under them it would be the flash kernel's own one-device run: a second
    interpret-mode program to compile, and not an independent computation)."""
    q, k, v, g, seg = inputs(rng, T=32, N=4, K=2, H=16)
    want = reference(q, k, v, g, seg, causal)
    with use_execution(kernels=KernelOptions(attention="pallas")):
        check_against_reference(q, k, v, g, seg, seq_mesh(n), causal=causal, impl="ring",
                                layout=layout, n=n, want=want)


@pytest.mark.slow
def test_bfloat16(rng):
    q, k, v, g, seg = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in inputs(rng))
    check_against_reference(q, k, v, g, seg, seq_mesh(4), causal=True, impl="ring", layout="natural",
                            n=4, tol=2e-2)


def test_zigzag_round_trip_and_order():
    x = np.arange(16)[None]
    assert to_zigzag(x, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert (from_zigzag(to_zigzag(x, 4), 4) == x).all()
    assert (np.asarray(from_zigzag(jnp.asarray(to_zigzag(x, 4)), 4)) == x).all()


def _while_bodies(hlo: str) -> dict[str, str]:
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    out = {}
    for name in bodies:
        match = re.search(rf"^%?{re.escape(name)} .*?\{{\n(.*?)\n\}}", hlo, re.S | re.M)
        out[name] = match.group(1)
    return out


@pytest.mark.slow
def test_next_transfer_is_issued_before_the_block_is_computed():
    """In every ring step of the compiled program (forward and backward), the keys and
    values for the next step are sent before this step's block computation and do not
    depend on it, so the transfer overlaps the computation. On GPU XLA makes the send
    asynchronous (collective-permute-start before the block, -done after); XLA:CPU's
    collectives are synchronous, and the schedule shows the issue order."""
    B, T, N, K, H = 1, 256, 4, 2, 32
    mesh = seq_mesh(4)
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731

    def loss(q, k, v):
        return ring_attention(q, k, v, mesh=mesh).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        sds(B, T, N, H), sds(B, T, K, H), sds(B, T, K, H)).compile()
    hlo = compiled.as_text()
    ring_steps = {name: body for name, body in _while_bodies(hlo).items() if "ring_send_kv" in body}
    assert len(ring_steps) == 2  # forward and backward
    for body in ring_steps.values():
        lines = body.splitlines()
        sends = [i for i, l in enumerate(lines) if "ring_send_kv" in l and "collective-permute" in l]
        # The block's computation: its matmuls, inside the conditionals of the causal skip.
        block = [i for i, l in enumerate(lines) if "ring_block" in l and " conditional(" in l]
        assert len(sends) in (2, 4) and block  # k and v (start + done on GPU)
        starts = [i for i in sends if "collective-permute-done" not in lines[i]]
        assert max(starts) < min(block)
        dones = [i for i in sends if "collective-permute-done" in lines[i]]
        assert all(i > max(block) for i in dones)


def test_ring_traffic_is_the_closed_form_and_memory_linear_rsa_holds_score_rows():
    """Compile-only. Per device per forward + backward: k and v hop n - 1 times each way,
    and their float32 gradients n times (home included); the profiler's count is exact.
    The ring's temporaries stay far below one device's [T/n, T] score rows, which Ring
    Self-Attention holds by design. (One test: the ring's program compiled once for both
    checks.)"""
    B, T, N, K, H, n = 1, 4096, 8, 2, 64, 8
    mesh = seq_mesh(n)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=spec)  # noqa: E731
    temp = {}
    for impl in ("ring", "rsa"):
        def loss(q, k, v, impl=impl):
            return ring_attention(q, k, v, mesh=mesh, impl=impl, layout="zigzag").sum()

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
            sds(B, T, N, H), sds(B, T, K, H), sds(B, T, K, H)).compile()
        temp[impl] = compiled.memory_analysis().temp_size_in_bytes
        if impl == "ring":
            block = B * (T // n) * K * H * 4
            assert jaxpar.profiler.profile(compiled)["collectives"]["collective-permute"] == (
                2 * (n - 1) * 2 * block + n * 2 * block)
    score_rows = B * N * (T // n) * T * 4
    assert temp["rsa"] >= score_rows
    assert temp["ring"] < score_rows / 4


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_memory_stays_linear_inside_a_differentiated_layer_scan(impl):
    """The model scans its layers; nothing of the ring's forward may be kept per ring
    step or key block there (jaxpar.parallel.sequence._tied): a scan over two layers
    needs no more temporaries than the two layers unrolled, give or take."""
    B, T, N, H, n = 1, 8192, 8, 32, 8
    mesh = seq_mesh(n)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))

    def layer(x, w, seg):
        return x + ring_attention(x * w, x, x, mesh=mesh, segment_ids=seg, impl=impl,
                                  layout="zigzag"), None

    def scanned(x, ws, seg):
        return jax.lax.scan(lambda x, w: layer(x, w, seg), x, ws)[0].sum()

    def unrolled(x, ws, seg):
        for i in range(2):
            x, _ = layer(x, ws[i], seg)
        return x.sum()

    temp = {}
    for name, f in (("scanned", scanned), ("unrolled", unrolled)):
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(
            jax.ShapeDtypeStruct((B, T, N, H), jnp.float32, sharding=spec),
            jax.ShapeDtypeStruct((2,), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=spec)).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["scanned"] < 1.25 * temp["unrolled"], temp


@pytest.mark.parametrize("call,message", [
    (dict(T=60, layout="zigzag"), "zigzag layout needs the length divisible by 2 x seq = 8, got T=60"),
    (dict(T=62), "length T=62 is not divisible by seq=4"),
    (dict(N=6, K=6, impl="ulysses"), "ulysses splits the heads over seq=4, but there are 6 query heads per device"),
    (dict(axis="sequence"), "the mesh has no axis 'sequence'"),
    (dict(impl="flash"), "impl='flash' is not one of"),
])
def test_bad_input_names_the_sizes(rng, call, message):
    call = dict(call)
    T, N, K = call.pop("T", 64), call.pop("N", 8), call.pop("K", 2)
    q, k, v, _, _ = inputs(rng, T=T, N=N, K=K, H=16)
    with pytest.raises(ValueError, match=re.escape(message)):
        ring_attention(q, k, v, mesh=seq_mesh(4), **call)


# The model --------------------------------------------------------------------------

CFG = ModelConfig(vocab_size=128, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=96)


def batches(rng, steps=3, B=8, T=16):
    """Packed rows: several documents per row, positions restarting at each. Every key
    the loader gives, in test_parallel.py's shapes: the one-device step is its
    single_device_run's program (CFG is its model), one compile in a test run for both."""
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
        seg = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
        starts = np.concatenate([np.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        index = np.broadcast_to(np.arange(T), (B, T))
        positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
                    "positions": positions.astype(np.int32), "mask": np.ones((B, T), np.int32)})
    return out


def train(data, mesh=None, sequence=SequenceOptions()):
    n = mesh.shape["seq"] if mesh is not None else 1

    def prepare(batch):
        if sequence.layout == "zigzag":
            batch = {key: to_zigzag(x, n) for key, x in batch.items()}
        return {key: jnp.asarray(x) for key, x in batch.items()}

    return train_steps(CFG, data, mesh, prepare=prepare, sequence=sequence)[:2]


@pytest.fixture(scope="module")
def single_device_run():
    data = batches(np.random.default_rng(2))
    return data, train(data)


@pytest.mark.slow
# (seq=4, ring) is not among them: the ring through the model is (seq=2, tensor=(2, 2))
# below, and four devices' rings test_ring_matches_full_attention's. Nor is (seq=2,
# tensor=4, ring): its 2 kv heads over tensor=4, whole on each device and picked by the
# query heads each device holds, are test_other_axes_split_batch_and_heads[tensor=4]'s
# check (the rules' replicated kv heads in training: test_parallel.py's tensor=4 meshes).
@pytest.mark.parametrize("sizes,impl,layout", [
    (dict(seq=4, data=2), "rsa", "zigzag"),
    (dict(seq=2, fsdp=2, tensor=2), "ulysses", "zigzag"),
    (dict(seq=2, tensor=(2, 2)), "ring", "zigzag"),  # heads over tensor_col
], ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else x)
def test_training_with_seq_matches_one_device(single_device_run, sizes, impl, layout):
    data, (ref_losses, ref_params) = single_device_run
    sizes = dict(sizes)
    n = sizes.pop("seq")
    losses, params = train(data, seq_mesh(n, **sizes), SequenceOptions(impl, layout))
    assert rel_err(losses, ref_losses) < 1e-5
    assert tree_rel_err(params, ref_params) < 1e-5
