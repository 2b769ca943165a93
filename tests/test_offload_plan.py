"""jaxpar.offload's plan as data: byte budgets, the planner's accounting on hand-made and
real abstract states (nothing runs; one compile, marked slow), and jaxpar-train's
``offload`` section."""

import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.offload import OffloadOptions, PlanError, parse_bytes, plan
from jaxpar.offload.budget import format_bytes
from jaxpar.offload.accounting import state_bytes
from jaxpar.offload.planner import decided
from jaxpar.train.config import ConfigError, load_config
from conftest import lowerings


# --------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    (4096, 4096), ("2 KiB", 2048), ("1.5KiB", 1536), ("3TB", 3 * 10**12), ("1TiB", 2**40),
    ("10B", 10), ("0", 0), (2.0e9, 2_000_000_000), ("1e9", 10**9), ("2.5e3", 2500), ("0.5KiB", 512),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["6G", "6 gigs", "-1GiB", "GiB", "1.5", "", "6gib", "1e-3", -5, 1.5, True, None, [1]])
def test_parse_bytes_refuses_anything_else_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^offload.device_budget=.* is not a byte count: give an "
                                         r"integer or a number with one of the units B/KB/MB/GB/TB/KiB/MiB/GiB/TiB"):
        parse_bytes(bad, name="offload.device_budget")


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 6 * 2**30, 3 * 2**40)] == \
        ["0B", "1023B", "1.5KiB", "6GiB", "3TiB"]


# ------------------------------------------------------------- a hand-made train state

L = 4


def _state():
    """params: an embedding [64, 32] and one stacked weight [L, 32, 64], f32, split over
    fsdp=8 (1 KiB per device each, per layer for the stack); Adam-like mu and nu copies
    and a replicated int32 counter."""
    mesh = jaxpar.make_mesh(fsdp=8)
    sds = lambda shape, spec, dtype=jnp.float32: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec))
    params = {"embed": sds((64, 32), P("fsdp", None)), "layers": {"w": sds((L, 32, 64), P(None, "fsdp", None))}}
    opt = {"mu": params, "nu": params, "count": sds((), P(), jnp.int32)}
    return {"params": params, "opt_state": opt}, mesh


# No lm_head: the embedding is tied, one fetch for the lookup and two for the head
# (forward, backward), a gradient sent for each use (accounting.NON_LAYER_USES).
STATE_BYTES = dict(layers=L, layer_params=1024, layer_optimizer=2048, other_params=1024, other_optimizer=2052,
                   chunk_in=1024, chunk_out=1024, other_fetched=3 * 1024, other_sent=2 * 1024)
STATE = L * (1024 + 2048) + 1024 + 2052  # 15364 bytes per device
PARAMS = L * 1024 + 1024


def _profile(temp_extra=10_000, flops=1e9):
    """What a compile of the all-on-device step would say: the state and a 100-byte batch
    as arguments, state + 4 bytes out (all but the loss aliased), the whole gradient and
    ``temp_extra`` bytes of temporaries."""
    return {"argument_bytes": STATE + 100, "output_bytes": STATE + 4, "alias_bytes": STATE,
            "temp_bytes": PARAMS + temp_extra, "flops": flops}


def test_state_bytes_are_per_device_shards_split_by_layer():
    state, _ = _state()
    assert state_bytes(state).__dict__ == STATE_BYTES


def test_all_on_device_plan_is_the_profiles_peak():
    state, mesh = _state()
    profile = _profile()
    p = plan(state, mesh, profile, None)
    assert p.options == OffloadOptions() and p.resident_layers == L
    peak = profile["argument_bytes"] + profile["output_bytes"] - profile["alias_bytes"] + profile["temp_bytes"]
    assert p.device_bytes == peak
    assert p.device_state_bytes == STATE and p.host_bytes == 0
    assert p.host_to_device == p.device_to_host == 0


def test_partial_residency_accounting_term_by_term():
    """params=host with 1 of 4 layers resident, prefetch 1, optimizer on the device: the
    embedding lives on the host with the 3 other layers, and the update brings every
    host parameter and gradient to the device."""
    state, mesh = _state()
    p = plan(state, mesh, _profile(), None, params="host", resident_layers=1, optimizer="device")
    assert p.options == OffloadOptions(params="host", resident_layers=1, optimizer="device")
    assert p.device == {
        "params": 1024,  # the resident layer (the embedding is a host chunk)
        "optimizer": L * 2048 + 2052,
        "fetched": 1024 + 1024,  # the layer fetched ahead + the larger of a layer and the embedding chunk
        "gradients": 1024 + 2 * 1024,  # the resident layer's + the chunk made and the one draining
        "update": 2 * 4096,  # the host params (3 layers + embedding) and their gradients, for the update
        "temporaries": 10_000,  # temp_bytes less the whole gradient
        "activations": 0,
        "inputs_outputs": 100 + 4,
    }
    # the host layers' and embedding's gradients are made there, then brought in for the update
    assert p.host == {"params": 3 * 1024 + 1024, "optimizer": 0, "gradients": 3 * 1024 + 1024, "activations": 0}
    # 3 host layers fetched in the forward and the backward, each pass filling its window
    # (1 layer) and ending on a wasted refetch: 2 (3 + 1) fetches; the embedding fetched
    # for the lookup and for the head twice; then the update's host params and gradients
    assert p.host_to_device == 2 * (3 + 1) * 1024 + 3 * 1024 + 2 * 4096
    # the host layers' gradients, the embedding's two (one per use), the updated host params
    assert p.device_to_host == 3 * 1024 + 2 * 1024 + 4096
    assert p.device_state_bytes + p.host_state_bytes == STATE
    assert p.between_steps_bytes == 1024 + L * 2048 + 2052 + 104


def test_optimizer_device_with_params_host_never_promises_less_than_all_on_device():
    """The update holds P + G + O on the device whatever the residency, and the fetched
    chunks come on top: params=host saves device bytes only with optimizer=host."""
    state, mesh = _state()
    everything = plan(state, mesh, _profile(), None).device_bytes
    for r in range(L + 1):
        p = plan(state, mesh, _profile(), None, params="host", resident_layers=r, optimizer="device")
        assert p.device_bytes > everything, r
    p = plan(state, mesh, _profile(), None, params="host", resident_layers=0, optimizer="host")
    assert p.device_bytes < everything


def test_optimizer_on_host_moves_every_gradient_and_the_device_params():
    state, mesh = _state()
    p = plan(state, mesh, _profile(), None, params="device", optimizer="host")
    assert p.device["optimizer"] == 0 and p.device["update"] == 0
    assert p.host["optimizer"] == L * 2048 + 2052 and p.host["gradients"] == PARAMS
    # gradients and params to the host for the update, the new params back
    assert p.host_to_device == PARAMS and p.device_to_host == 2 * PARAMS


def test_grad_accum_sums_host_gradients_on_the_host():
    """params=host, optimizer=host, 2 microbatches: the host layers' gradients are summed
    on the host, so the device holds the resident layer's accumulator and a microbatch's
    gradient of it beside the chunks in flight, and the temporaries lose the two whole
    gradients the all-on-device step holds; each microbatch moves what one step without
    accumulation moves, and only the resident layer's gradient goes to the host update."""
    state, mesh = _state()
    profile = _profile()
    profile["temp_bytes"] += PARAMS  # the all-on-device step's second whole gradient
    p = plan(state, mesh, profile, None, params="host", resident_layers=1, optimizer="host", grad_accum=2)
    assert p.device["gradients"] == 2 * 1024 + 2 * 1024 and p.device["update"] == 0
    assert p.device["temporaries"] == 10_000
    assert p.host_to_device == 2 * (2 * (3 + 1) * 1024 + 3 * 1024) + 1024
    assert p.device_to_host == 2 * (3 * 1024 + 2 * 1024) + 2 * 1024
    everything = plan(state, mesh, profile, None, grad_accum=2)
    assert everything.device["gradients"] == PARAMS and everything.device["temporaries"] == PARAMS + 10_000
    with pytest.raises(ValueError, match=r"optimizer.grad_accum=0 must be an int >= 1"):
        plan(state, mesh, _profile(), None, grad_accum=0)


def test_prefetch_window_holds_prefetch_layers_and_the_one_computing():
    """The streamed scan carries min(prefetch, H) fetched layers and each step fetches
    one more (past the end: the last layer again), so prefetch 8 over 4 host layers
    holds 5 copies."""
    state, mesh = _state()
    window = [plan(state, mesh, _profile(), None, params="host", resident_layers=0, optimizer="device",
                   prefetch=k).device["fetched"] for k in (1, 2, 3, 8)]
    assert window == [2 * 1024, 3 * 1024, 4 * 1024, 5 * 1024]


def test_offloaded_activations_free_only_what_the_profile_saved_and_always_move():
    state, mesh = _state()
    sizes = {"query": 4000, "mlp_hidden": 8000}
    args = (state, mesh, _profile(temp_extra=50_000), None)
    plain = plan(*args, params="device", optimizer="device")
    kept = plan(*args, params="device", optimizer="device", activation_bytes=sizes,
                saved_names=("query", "mlp_hidden"))
    moved = plan(*args, params="device", optimizer="device", activations=("query",),
                 activation_bytes=sizes, saved_names=("query", "mlp_hidden"))
    unknown = plan(*args, params="device", optimizer="device", activations=("query",), activation_bytes=sizes)
    # saved activations are part of the temporaries: named apart, the total is the same
    assert kept.device["activations"] == 12_000 and kept.device["temporaries"] == 50_000 - 12_000
    assert kept.device_bytes == plain.device_bytes
    # query leaves the device but two layers' worth (the one computing, the one fetched) are in flight
    assert moved.device["activations"] == 8000 + 2 * 4000 // L
    assert moved.device_bytes == plain.device_bytes - 4000 + 2 * 4000 // L
    assert moved.host["activations"] == 4000 and moved.host_to_device == moved.device_to_host == 4000
    # not known to be saved: nothing freed, the moves still counted
    assert unknown.device_bytes == plain.device_bytes + 2 * 4000 // L and unknown.host_to_device == 4000
    with pytest.raises(ValueError, match=r"activation_bytes gives no size for offloaded activations \['key'\]"):
        plan(*args, activations=("key",), activation_bytes=sizes)


def _sweep(state, mesh, profile, budgets, **options):
    """The plans chosen under each budget, each checked to keep its promise."""
    plans = []
    for budget in budgets:
        p = plan(state, mesh, profile, int(budget), **options)
        assert p.device_bytes <= budget and p.fits
        plans.append(p)
    return plans


def test_more_layers_stay_resident_as_the_budget_grows_and_no_plan_promises_more():
    state, mesh = _state()
    profile = _profile(flops=1e5)  # transfer-bound: every host layer costs time
    smallest = plan(state, mesh, profile, None, params="host", resident_layers=0, optimizer="host").device_bytes
    largest = plan(state, mesh, profile, None).device_bytes
    budgets = np.linspace(smallest, largest, 12).astype(int)
    resident = [p.resident_layers for p in _sweep(state, mesh, profile, budgets, params="auto", optimizer="host")]
    assert resident == sorted(resident) and resident[0] == 0 and resident[-1] == L, resident
    # with the optimizer on the device nothing below all on the device fits (the update)
    assert {p.options for p in _sweep(state, mesh, profile, [largest, 2 * largest], optimizer="device")} \
        == {OffloadOptions()}
    # both searched: a larger budget never gives a slower plan; the largest, all on the device
    chosen = _sweep(state, mesh, profile, budgets)
    times = [p.step_s for p in chosen]
    assert times == sorted(times, reverse=True) and chosen[-1].options == OffloadOptions()
    assert chosen[0].options == OffloadOptions(params="host", resident_layers=0, optimizer="host")


def test_the_fastest_fitting_plan_wins_and_ties_keep_more_on_the_device():
    state, mesh = _state()
    compute_bound = plan(state, mesh, _profile(flops=1e15), 10**9, params="auto", optimizer="device")
    assert compute_bound.options == OffloadOptions()  # same time, fewer bytes moved
    forced = plan(state, mesh, _profile(flops=1e15), 10**9, params="host", optimizer="device")
    assert forced.options.params == "host" and forced.resident_layers == L


def test_nothing_fits_names_the_smallest_budget_and_what_dominates_it():
    state, mesh = _state()
    profile = _profile(temp_extra=50_000)
    smallest = plan(state, mesh, profile, None, params="host", resident_layers=0, optimizer="host")
    with pytest.raises(PlanError) as error:
        plan(state, mesh, profile, "1KiB")
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        f"a device budget of 1KiB is below what any plan needs: the smallest (params=host "
        f"resident_layers=0/4 prefetch=1 optimizer=host) needs {format_bytes(smallest.device_bytes)} per "
        f"device ({smallest.device_bytes} bytes), most of it the step's compiled temporaries (48.8KiB)")
    assert error.value.smallest.device_bytes == smallest.device_bytes
    assert plan(state, mesh, profile, smallest.device_bytes).device_bytes == smallest.device_bytes


def test_params_host_alone_without_a_budget_keeps_no_layer_resident():
    state, mesh = _state()
    p = plan(state, mesh, _profile(), None, params="host", optimizer="device")
    assert p.options == OffloadOptions(params="host", resident_layers=0)


@pytest.mark.parametrize("kwargs,budget,one", [
    (dict(params="host", optimizer="host"), None, True),  # resident_layers implied: none
    (dict(params="host", optimizer="device", resident_layers=2), None, True),
    (dict(params="auto", optimizer="host", resident_layers=2), None, True),  # 2 < L: host only
    (dict(params="auto", optimizer="device", resident_layers=L), None, True),  # every layer: device only
    (dict(params="host", optimizer="host"), "1MiB", False),  # a budget to check
    (dict(params="host", optimizer="auto"), None, False),
    (dict(params="auto", optimizer="host"), None, False),
    (dict(params="host", optimizer="host", resident_layers=L + 1), None, False),  # plan says why
])
def test_a_fixed_placement_without_a_budget_is_decided_without_a_profile(kwargs, budget, one):
    """``decided``: one candidate and no budget. Then ``plan(profile=None)`` picks what it
    picks with the profile (the profile's figures count 0); otherwise it refuses."""
    state, mesh = _state()
    assert decided(state, budget, **kwargs) is one
    if one:
        with_profile = plan(state, mesh, _profile(), budget, **kwargs)
        without = plan(state, mesh, None, budget, **kwargs)
        assert without.options == with_profile.options and without.resident_layers == with_profile.resident_layers
        assert without.device_state_bytes == with_profile.device_state_bytes
        assert without.device["temporaries"] == 0 < with_profile.device["temporaries"]
    elif kwargs.get("resident_layers", 0) <= L:
        with pytest.raises(ValueError, match=r"^plan: without a profile, only one placement and no budget"):
            plan(state, mesh, None, budget, **kwargs)


def test_bad_arguments():
    state, mesh = _state()
    with pytest.raises(ValueError, match=r"offload.params='cpu' must be one of \['device', 'host', 'auto'\]"):
        plan(state, mesh, _profile(), None, params="cpu")
    with pytest.raises(ValueError, match="offload.resident_layers=5 must be between 0 and the model's 4"):
        plan(state, mesh, _profile(), None, params="host", resident_layers=5)
    with pytest.raises(ValueError, match="offload.prefetch=0 must be an int >= 1"):
        plan(state, mesh, _profile(), None, prefetch=0)
    with pytest.raises(ValueError, match="offload.device_budget='lots' is not a byte count"):
        plan(state, mesh, _profile(), "lots")
    with pytest.raises(ValueError, match="offload.resident_layers=1 with mesh.pipe=2 is not supported yet: a "
                                         "pipeline's stages hold their layers whole"):
        plan(state, jaxpar.make_mesh(pipe=2, fsdp=4), _profile(), None, params="host", resident_layers=1)


def test_plan_data_is_json_and_describe_is_readable():
    state, mesh = _state()
    p = plan(state, mesh, _profile(), None, params="host", resident_layers=1, optimizer="host")
    data = json.loads(json.dumps(p.to_dict()))
    assert data["params"] == "host" and data["resident_layers"] == 1 and data["layers"] == L
    assert data["device_bytes"] == sum(data["device"].values()) == p.device_bytes
    assert data["host_to_device_bytes"] == p.host_to_device
    text = p.describe()
    assert text.splitlines()[0] == "offload plan: params=host resident_layers=1/4 prefetch=1 optimizer=host"
    assert "temporaries" in text and "host->device" in text


# ------------------------------------------------------------ against the step it plans


def _transfers(jaxpr, times=1):
    """``(host_to_device, device_to_host)`` bytes of a traced step's ``device_put``s, each
    counted as often as it runs (a scan body ``length`` times). Those inside host
    computation (``compute_on``) are not counted: there every array is made in host
    memory, and a ``device_put`` to the host only retypes one (``creating_on_host``)."""
    from jaxpar.offload.fetch import DEVICE, HOST

    h2d = d2h = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "compute_on":
            continue
        if eqn.primitive.name == "device_put":
            for var, dst in zip(eqn.invars, eqn.params["devices"]):
                nbytes = var.aval.size * var.aval.dtype.itemsize * times
                h2d += nbytes if dst == DEVICE and var.aval.memory_space == HOST else 0
                d2h += nbytes if dst == HOST and var.aval.memory_space != HOST else 0
        inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            h2d, d2h = np.add((h2d, d2h), _transfers(sub, inner))
    return int(h2d), int(d2h)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.slow
def test_plan_is_what_the_step_places_and_moves(tied):
    """The plan's state bytes by memory against the step's stored shardings, and its
    transfer bytes against the device_puts of the traced step (nothing compiles), for
    host layers with and without resident ones, prefetch past the host layers, and both
    optimizer placements. On data=8 the parameters are replicated: per device = whole."""
    from jaxpar.models import ModelConfig, Transformer
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train.step import BATCH_KEYS, make_train_step

    cfg = ModelConfig(vocab_size=64, dim=32, layers=3, heads=2, kv_heads=2, head_dim=16, mlp_dim=48,
                      tie_embeddings=tied)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    mesh = jaxpar.make_mesh(data=8)
    rules, tx = sharding_rules(cfg, mesh), optax.adamw(1e-2)
    abstract = make_train_step(model, tx, mesh, rules).abstract_state(model)
    placements = [(0, "device", 1, 1), (1, "host", 2, 1), (3, "host", 1, 1), (2, "device", 3, 1),
                  (None, "host", 1, 1), (1, "host", 1, 2), (0, "device", 2, 4)]
    if tied:  # what a tied embedding changes, its host chunk's fetches and gradients: with
        # the parameters on the host, both optimizer placements, with and without accumulation
        placements = [(0, "device", 1, 1), (1, "host", 2, 1), (1, "host", 1, 2), (0, "device", 2, 4)]
    for resident, optimizer, prefetch, k in placements:
        where = dict(params="device") if resident is None else dict(params="host", resident_layers=resident)
        p = plan(abstract, mesh, {}, None, optimizer=optimizer, prefetch=prefetch, grad_accum=k, **where)
        step = make_train_step(model, tx, mesh, rules, offload=p.options, grad_accum=k)
        stored = step.abstract_state(model, stored=True)
        placed = {"device": 0, "pinned_host": 0}
        for x in jax.tree.leaves(stored):
            placed[x.sharding.memory_kind] += x.size * x.dtype.itemsize
        assert (placed["device"], placed["pinned_host"]) == (p.device_state_bytes, p.host_state_bytes), p.summary()
        token = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=step.batch_sharding)
        with step.context():
            traced = step.step.trace(stored["params"], stored["opt_state"], dict.fromkeys(BATCH_KEYS, token))
        # the host update's gradient norm (a float32 scalar) comes back to the device too,
        # and each microbatch's share of the batch goes to the host for its sums there
        norm = 4 if optimizer == "host" else 0
        shares = 4 * k if k > 1 and resident is not None and resident < 3 else 0
        assert _transfers(traced.jaxpr.jaxpr) == (p.host_to_device + norm, p.device_to_host + shares), p.summary()



@pytest.mark.slow
def test_an_accumulating_all_on_device_step_holds_two_whole_gradients():
    """What the planner takes out of an accumulating step's temporaries when the host
    layers' gradients are summed on the host: the all-on-device compile with 2
    microbatches holds the accumulator and a microbatch's gradient at once (the sum
    reads both): two whole gradients, most of one more than without accumulation."""
    from jaxpar.models import ModelConfig, Transformer
    from jaxpar.profiler import profile
    from jaxpar.train.step import BATCH_KEYS, make_train_step

    cfg = ModelConfig(vocab_size=256, dim=128, layers=2, heads=2, kv_heads=2, head_dim=64, mlp_dim=512)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    temp = {}
    for k in (1, 2):
        step = make_train_step(model, optax.adamw(1e-2), grad_accum=k)
        state = step.abstract_state(model, stored=True)
        token = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        compiled = step.step.trace(state["params"], state["opt_state"], dict.fromkeys(BATCH_KEYS, token)).lower().compile()
        temp[k] = profile(compiled)["temp_bytes"]
    assert temp[1] >= params and temp[2] >= 2 * params
    assert temp[2] - temp[1] > 0.75 * params  # the second: most of a gradient more


# ----------------------------------------------------------------- the 1b model, fsdp=8

# The all-on-device step of `1b` (vocabulary 32768) under fsdp=8, batch 8 x 2048, as
# XLA:CPU compiled it (jax 0.10.2): temp_bytes and flops per device
# (test_1b_plan_matches_its_compile checks them, slow).
TEMP_1B, FLOPS_1B, BATCH_1B = 6_114_297_080, 1.5111e13, 5 * 2048 * 4


@pytest.fixture(scope="module")
def state_1b():
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train.loop import build_mesh, build_model, make_optimizer
    from jaxpar.train.step import make_train_step

    cfg = load_config("1b", ["mesh.fsdp=8", "batch_size=8"])
    mesh = build_mesh(cfg)
    model = nnx.eval_shape(lambda: build_model(cfg))
    step = make_train_step(model, make_optimizer(cfg.optimizer, 10)[0], mesh, sharding_rules(cfg.model, mesh))
    return cfg, step, model, step.abstract_state(model), mesh


def test_1b_state_is_split_eight_ways(state_1b):
    cfg, _, _, state, _ = state_1b
    s = state_bytes(state)
    m = cfg.model
    matrices = m.dim * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.dim + 3 * m.dim * m.mlp_dim
    # f32 matrices split over fsdp, the two norm scales [D] replicated on every device
    assert s.layers == 16 and s.layer_params == matrices * 4 // 8 + 2 * m.dim * 4
    assert s.layer_optimizer == 2 * s.layer_params
    assert s.other_params == m.vocab_size * m.dim * 4 // 8 + m.dim * 4  # tied embedding, final norm


def test_1b_plans_under_budgets(state_1b):
    _, _, _, state, mesh = state_1b
    s = state_bytes(state)
    profile = {"argument_bytes": s.total + BATCH_1B, "output_bytes": s.total + 304, "alias_bytes": s.total,
               "temp_bytes": TEMP_1B, "flops": FLOPS_1B}
    everything = plan(state, mesh, profile, None)
    assert everything.options == OffloadOptions() and everything.device_bytes == \
        profile["argument_bytes"] + profile["output_bytes"] - profile["alias_bytes"] + TEMP_1B
    smallest = plan(state, mesh, profile, None, params="host", resident_layers=0, optimizer="host")
    budgets = np.linspace(smallest.device_bytes, everything.device_bytes, 6).astype(int)
    # with the update on the host, a resident layer's gradients and parameters cross at the
    # update (exposed), a host layer's stream behind its compute: every budget streams all
    resident = [p.resident_layers for p in _sweep(state, mesh, profile, budgets, optimizer="host")]
    assert resident == [0] * 6, resident
    budgets = np.linspace(smallest.device_bytes, everything.device_bytes, 9).astype(int)
    chosen = _sweep(state, mesh, profile, budgets)
    assert [p.step_s for p in chosen] == sorted((p.step_s for p in chosen), reverse=True)
    assert chosen[0].options.optimizer == "host" and chosen[-1].options == OffloadOptions()
    with pytest.raises(PlanError, match="a device budget of 4GiB is below what any plan needs: .* most of it "
                                        "the step's compiled temporaries"):
        plan(state, mesh, profile, "4GiB")


@pytest.mark.slow
def test_1b_plan_matches_its_compile(state_1b):
    """The all-on-device plan against XLA:CPU's compile of the 1b step (8 s on 2 cores)."""
    from jaxpar.profiler import profile as profile_of

    cfg, step, model, state, mesh = state_1b
    profile = profile_of(step.compile(model, cfg.batch_size, cfg.seq_len))
    p = plan(state, mesh, profile, None)
    assert abs(p.device_bytes - profile["peak_bytes"]) <= 0.1 * profile["peak_bytes"]
    assert abs(p.device_state_bytes - profile["alias_bytes"]) <= 0.1 * profile["alias_bytes"]
    assert profile["argument_bytes"] - p.device_state_bytes == BATCH_1B
    assert abs(profile["temp_bytes"] - TEMP_1B) <= 0.1 * TEMP_1B
    assert abs(profile["flops"] - FLOPS_1B) <= 0.1 * FLOPS_1B


# ------------------------------------------------------------- the model's checkpoint names


def test_checkpoint_names_are_the_ones_the_model_tags():
    from jaxpar.models import ModelConfig, Remat, Transformer
    from jaxpar.models.config import CHECKPOINT_NAMES

    # remat on: layer_input is named inside the layer's checkpoint
    cfg = ModelConfig(vocab_size=64, dim=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp_dim=32)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), remat=Remat("full")))
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.zeros((1, 4), jnp.int32))

    def names(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                yield eqn.params["name"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from names(sub)

    assert sorted(set(names(jaxpr.jaxpr))) == sorted(CHECKPOINT_NAMES)


# ------------------------------------------------------------------- the config section


def test_offload_section_parses():
    cfg = load_config("tiny", ["offload.params=auto", "offload.optimizer=host", "offload.activations=[query,key]",
                               "offload.device_budget=6GiB", "offload.resident_layers=2", "offload.prefetch=2",
                               "offload.host_bandwidth=32GB"])
    o = cfg.offload
    assert (cfg.layout.offload_params, cfg.layout.offload_optimizer, o.activations, o.resident_layers, o.prefetch) == \
        ("auto", "host", ("query", "key"), 2, 2)
    assert o.budget == 6 * 2**30 and o.bandwidth == 32e9
    assert load_config("tiny", ["offload.activations=none"]).offload.activations == ()
    assert load_config("tiny", ["offload.device_budget=4096"]).offload.budget == 4096
    assert load_config("tiny", ["offload.host_bandwidth=25e9"]).offload.bandwidth == 25e9
    assert load_config("tiny").offload_requested == ()
    assert load_config("tiny", ["offload.device_budget=1GB"]).offload_requested == ("offload.device_budget='1GB'",)


@pytest.mark.parametrize("overrides,message", [
    (["offload.device_budget=6G"], r"^offload.device_budget='6G' is not a byte count: give an integer or a number"),
    (["offload.device_budget=-1"], r"^offload.device_budget=-1 is not a byte count"),
    (["offload.host_bandwidth=fast"], r"^offload.host_bandwidth='fast' is not a byte count"),
    (["offload.params=cpu"], r"^offload.params='cpu' must be one of \['device', 'host', 'auto'\]$"),
    (["offload.params=host", "offload.resident_layers=5"], r"^offload.resident_layers=5 is above model.layers=4$"),
    (["offload.resident_layers=1"], r"^offload.resident_layers=1 applies to offload.params=host or auto"),
    (["offload.prefetch=0"], r"^offload.prefetch=0 must be at least 1$"),
    (["offload.activations=[query,qkv]"],
     r"^offload.activations=\['query', 'qkv'\] names no checkpoint of the model \(qkv\); it defines "
     r"layer_input, query, key, value, attention, mlp_hidden$"),
    (["offload.optimizer=host", "mesh.pipe=2", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
     r"^offload.optimizer='host' with pipeline.schedule=interleaved \(stage_layers=None\) is not supported yet: an "
     r"interleaved pipeline's"),
    (["offload.params=host", "offload.resident_layers=1", "mesh.pipe=2"],
     r"^offload.resident_layers=1 with mesh.pipe=2 is not supported yet: a pipeline's stages hold their layers"),
])
def test_bad_offload_input_is_one_config_error_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config("tiny", overrides)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------ jaxpar-train with a budget


def test_activation_bytes_follow_the_shapes_and_the_mesh():
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train.loop import build_mesh
    from jaxpar.train.offload import activation_bytes, saved_names

    cfg = load_config("tiny", ["mesh.fsdp=4", "mesh.tensor=2", "batch_size=16", "optimizer.grad_accum=2"])
    mesh = build_mesh(cfg)
    sizes = activation_bytes(cfg, mesh, sharding_rules(cfg.model, mesh))
    m, rows = cfg.model, 16 // 2 // 4  # a microbatch's rows per data-parallel group (fsdp=4)
    assert sizes["query"] == sizes["attention"] == m.layers * rows * 128 * (m.heads // 2) * m.head_dim * 4
    assert sizes["key"] == sizes["value"] == m.layers * rows * 128 * (m.kv_heads // 2) * m.head_dim * 4
    assert sizes["mlp_hidden"] == m.layers * rows * 128 * (m.mlp_dim // 2) * 4
    assert saved_names(cfg.layout) == ("layer_input", "query", "key", "value", "attention", "mlp_hidden")
    assert saved_names(load_config("tiny", ["model.remat=names", "model.remat_names=[key]"]).layout) == ("key",)
    assert saved_names(load_config("small").layout) == ()


def test_device_live_bytes_counts_device_memory_on_the_most_loaded_device():
    """Per device, device memory only (other tests' arrays may be live in this process:
    the counts are compared device by device, before and after)."""
    import gc

    from jaxpar.train.offload import device_live_bytes, live_bytes_per_device

    mesh = jaxpar.make_mesh(fsdp=8)
    gc.collect()
    before = live_bytes_per_device()
    on_host = jax.device_put(np.ones((8, 1024), np.float32), NamedSharding(mesh, P(), memory_kind="pinned_host"))
    assert on_host.sharding.memory_kind == "pinned_host" and live_bytes_per_device() == before
    one = jax.device_put(np.ones((1024,), np.float32), jax.devices()[3])  # 4 KiB on device 3 only
    split = jax.device_put(np.ones((8, 1024), np.float32), NamedSharding(mesh, P("fsdp")))  # 4 KiB each
    after = live_bytes_per_device()
    assert {d: after[d] - before[d] for d in jax.devices()} == {
        d: 8192 if d == jax.devices()[3] else 4096 for d in jax.devices()}
    assert device_live_bytes() == max(after.values())
    del one, split, on_host


def test_a_fixed_placement_without_a_budget_compiles_no_all_on_device_step(tmp_path, monkeypatch):
    """train()'s build for offload.params=host offload.optimizer=host
    offload.resident_layers=1 without a budget (CPU: no device memory limit) lowers no
    program: the plan has one candidate, so the all-on-device step is not compiled for a
    profile; the step built is the offloaded one. (Its training equals the all-on-device
    one's: tests/test_offload_resume.py.) A dry run of the same config still
    profiles the all-on-device step for the plan's figures (a stand-in profile here: the
    real one's dry run is test_dry_run_reports_the_plan_...)."""
    from jaxpar.train import loop, tasks

    overrides = ["model.layers=2", "model.dim=32", "model.heads=2", "model.kv_heads=2", "model.head_dim=16",
                 "model.mlp_dim=64", "model.vocab_size=512", "seq_len=32", "batch_size=8", f"run_dir={tmp_path}",
                 "offload.params=host", "offload.optimizer=host", "offload.resident_layers=1"]
    cfg = load_config("tiny", overrides)
    with lowerings() as lowered:
        setup = loop.build(cfg, tasks.of(cfg))
    assert lowered == []
    assert setup.profile is None
    assert setup.offload_plan.options == OffloadOptions(params="host", resident_layers=1, optimizer="host")
    assert setup.step_fn.offloading and setup.step_fn.split == (1, 2)

    profiled = []
    monkeypatch.setattr(loop, "dry_run_profile", lambda cfg, step_fn, *_: profiled.append(step_fn) or {
        "temp_bytes": 2**30})
    cfg = load_config("tiny", overrides + ["dry_run=true"])
    dry = loop.build(cfg, tasks.of(cfg))
    assert len(profiled) == 1 and not profiled[0].offloading  # the all-on-device step's profile
    assert dry.offload_plan.options == setup.offload_plan.options
    assert dry.offload_plan.device["temporaries"] > 0  # the profile's figures in the plan


@pytest.mark.slow
def test_dry_run_reports_the_plan_offloads_under_a_budget_and_refuses_one_nothing_fits(tmp_path, capsys):
    """tiny (4 layers) on fsdp=8, one all-on-device compile for three budgets (one test:
    the first dry run's profile is the all-on-device figures the second is set against):

    * a budget the all-on-device step fits: the plan is all on the device, its promise
      the profile's peak;
    * one byte less than the all-on-device peak (under a budget the all-on-device step
      exceeds only optimizer=host plans fit: with the optimizer on the device the update
      holds every parameter and gradient there): the plan offloads, keeps its promise,
      and the step is built with its OffloadOptions (on CPU the compile still counts
      host state as device memory: profiler docstring);
    * no budget, offload.params=host offload.resident_layers=2 (the README's dry run,
      there on 1b): that placement, 2 of the 4 layers' parameters on the host;
    * one below every plan: a ConfigError, which jaxpar-train exits 2 on, before
      anything is written."""
    from jaxpar.train.loop import train

    base = ["dry_run=true", "mesh.fsdp=8", "batch_size=8", "seq_len=64", f"run_dir={tmp_path / 'run'}",
            "offload.params=auto", "offload.optimizer=auto"]
    train(load_config("tiny", base + ["offload.device_budget=1GiB"]), progress=False)
    everything = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    p = everything["offload_plan"]
    assert (p["params"], p["optimizer"], p["resident_layers"], p["budget_bytes"]) == ("device", "device", 4, 2**30)
    assert everything["device_state_bytes"] == everything["alias_bytes"] and everything["host_state_bytes"] == 0
    assert everything["transfer_bytes"] == {"host_to_device": 0, "device_to_host": 0}
    assert p["device_bytes"] == everything["peak_bytes"] == sum(p["device"].values())

    train(load_config("tiny", base + [f"offload.device_budget={everything['peak_bytes'] - 1}"]), progress=False)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    p = out["offload_plan"]
    assert p["device_bytes"] <= everything["peak_bytes"] - 1 and (p["params"], p["optimizer"]) != ("device", "device")
    assert out["host_state_bytes"] > 0 and out["device_state_bytes"] + out["host_state_bytes"] == everything["alias_bytes"]
    assert out["transfer_bytes"]["host_to_device"] > 0 and out["transfer_bytes"]["device_to_host"] > 0

    # the README's fixed placement (there on 1b, 4 of its 16 layers resident): 2 of the 4 here, no search
    fixed = [o for o in base if not o.startswith("offload.")] + ["offload.params=host", "offload.resident_layers=2"]
    train(load_config("tiny", fixed), progress=False)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    p = out["offload_plan"]
    assert (p["params"], p["resident_layers"], p["layers"], p["optimizer"]) == ("host", 2, 4, "device")
    assert out["host_state_bytes"] > 0 and out["device_state_bytes"] + out["host_state_bytes"] == everything["alias_bytes"]

    # the smallest plan streams all four layers, the embedding and head with them
    with pytest.raises(ConfigError, match=r"^offload.device_budget=1MiB is below what any plan needs: the smallest "
                                          r"\(params=host resident_layers=0/4 prefetch=1 optimizer=host\) needs .* "
                                          r"most of it the step's "
                                          r"compiled temporaries"):
        train(load_config("tiny", base + ["dry_run=false", "offload.device_budget=1MiB"]), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_auto_under_a_budget_the_all_on_device_step_exceeds_trains_the_same(tmp_path, capsys):
    """tiny (4 layers, fsdp=8, 2 microbatches a step) through train() with
    offload.params=auto offload.optimizer=auto under the device bytes of the plan with 2
    of 4 layers resident and the optimizer on the host, below the all-on-device plan's:
    the search keeps 2 layers resident (under accumulation a streamed layer is fetched
    once per microbatch, a resident one moves only at the update, so the most resident
    layers that fit are fastest), the losses equal the all-on-device run's, and between
    steps the live device arrays (device_live_bytes) stay within the plan's
    between_steps_bytes (device-resident state + batch + outputs; the peak inside a step
    is not visible from outside it) and below the all-on-device run's."""
    from conftest import rel_err
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train import offload as offload_lib
    from jaxpar.train.loop import build_mesh, build_model, make_optimizer, train
    from jaxpar.train.offload import device_live_bytes
    from jaxpar.train.step import make_train_step

    base = ["model.vocab_size=512", "data.max_files=20", "data.val_fraction=0.1", "seq_len=32",
            "batch_size=16", "optimizer.grad_accum=2", "mesh.fsdp=8", "steps=3", "eval.every=0",
            "checkpoint.every=0", "optimizer.warmup_steps=1"]
    auto = ["offload.params=auto", "offload.optimizer=auto"]
    train(load_config("tiny", base + auto + ["dry_run=true", f"run_dir={tmp_path / 'dry'}"]), progress=False)
    profile = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the all-on-device step's
    everything = profile["offload_plan"]["device_bytes"]

    def resolve(*overrides):
        cfg = load_config("tiny", base + list(overrides))
        mesh = build_mesh(cfg)
        rules = sharding_rules(cfg.model, mesh)
        model = nnx.eval_shape(lambda: build_model(cfg))
        abstract = make_train_step(model, make_optimizer(cfg.optimizer, cfg.steps)[0], mesh, rules).abstract_state(model)
        return offload_lib.resolve(cfg, profile, abstract, mesh, rules, None)

    budget = resolve("offload.params=host", "offload.resident_layers=2", "offload.optimizer=host").device_bytes
    assert budget < everything
    chosen = resolve(*auto, f"offload.device_budget={budget}")
    assert (chosen.options.params, chosen.resident_layers, chosen.options.optimizer) == ("host", 2, "host")
    assert chosen.device_bytes <= budget and chosen.between_steps_bytes < budget

    reference = train(load_config("tiny", base + [f"run_dir={tmp_path / 'device'}"]), progress=False)
    before = device_live_bytes()  # arrays other tests left alive: not this run's
    run = train(load_config("tiny", base + auto + [f"offload.device_budget={budget}", f"run_dir={tmp_path / 'auto'}"]),
                progress=False)
    assert rel_err([r["loss"] for r in run], [r["loss"] for r in reference]) < 1e-6
    for record, ref in zip(run, reference):
        assert record["device_live_bytes"] <= before + chosen.between_steps_bytes, record
        assert record["device_live_bytes"] - before < ref["device_live_bytes"]
