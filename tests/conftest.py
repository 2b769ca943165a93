"""Every test sees 8 simulated CPU devices; a test that needs another count runs a
subprocess through ``run_python``."""

import contextlib
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid

# Python's bytecode caches are written, as Python does by default, even where the
# environment turns them off (PYTHONDONTWRITEBYTECODE=1, as on the CI machine): the
# README's test command installs with `pip install --no-compile` (pip would otherwise
# compile all ~21,000 files of the test extras, torch's, Ray's and transformers' mostly:
# 178 s of a 2-core machine's install against 85 s), and the modules the suite imports
# are compiled once, by the first process that imports them, instead of by every
# worker and subprocess (jax, flax, optax and orbax: 5.0 CPU seconds an import from
# source, 2.3 from their caches). Subprocesses inherit it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Must happen before jax is imported anywhere.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

# One persistent compilation cache and one tokenizer/packed-data cache per test run,
# shared by both xdist workers and every subprocess they start (the CLI runs, the
# notebook's kernel inherit the environment): the same tiny train step is compiled, and
# the same tokenizer trained, once per run rather than once per process or test file.
# XDG_CACHE_HOME also keeps the trainer's default cache (jaxpar.train.data.
# default_cache_dir) out of the user's ~/.cache. The controller names the run and hands
# the name to its workers as xdist's testrun uid (pytest_configure), which they find in
# PYTEST_XDIST_TESTRUNUID; the controller removes the directory when the run ends
# (pytest_unconfigure). A serial run (-n 0) is its own controller.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
RUN_CACHES = os.path.join(tempfile.gettempdir(), f"jaxpar-tests-{_RUN_ID}")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(RUN_CACHES, "compilation")
os.environ["XDG_CACHE_HOME"] = os.path.join(RUN_CACHES, "xdg")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Most of the suite's time is XLA compiling small programs, and most of that is LLVM
# optimising the CPU code it emits: backend optimisation level 0 halves a parallel test
# file's time (110 s -> 59 s for test_parallel.py on 2 cores), and XLA:CPU's older
# elemental emitters instead of its MLIR fusion emitters halve it again (test_parallel.py
# 72.5 s -> 35.2 s serially). The tests check what the programs compute, always against
# another program compiled alike, never how fast they run. Subprocesses (CLI runs,
# benchmark smokes, the notebook's kernel) inherit the flags.
#
# Offloading's checks against the all-on-device step (issue 18: within 1e-6, two programs
# that fuse differently) and the embedding cache's (bit for bit) ran under the default
# emitters in a pytest of their own from 2026-11-24, when the elemental emitters
# contracted their multiply-adds into FMAs differently; on 2026-11-29 (JAX 0.10) they
# pass under these flags as they are, and run with the rest (test_offload*.py,
# test_embedding_cache_training.py): 63 CPU seconds instead of 129 and no second pytest.
#
# XLA:CPU also splits each program's LLVM module into parts it compiles on a thread pool;
# with both cores already busy (two xdist workers) the parts only add work: one part
# took test_parallel.py + test_decoding.py from 76.5 to 69.5 CPU seconds (two
# interleaved runs each, 2026-11-29). It changes how the code is compiled, not what.
#
# And a program's operations run on its device's thread, not on Eigen's pool of threads
# as well: with three workers' devices already contending for two cores, the pool's
# threads only wait on each other (test_parallel.py + test_pipeline.py +
# test_sequence_parallel.py on three workers: 111 / 88 s against 131 / 96 s in two
# interleaved pairs, the same CPU seconds, 2026-11-29).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1",
                "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_multi_thread_eigen=false")
_OURS = ("--xla_backend_optimization_level", "--xla_cpu_parallel_codegen_split_count",
         "--xla_cpu_use_fusion_emitters", "--xla_cpu_multi_thread_eigen")  # a parent run's, replaced
_inherited = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in _OURS]
os.environ["XLA_FLAGS"] = " ".join((*_inherited, *FAST_COMPILE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402


# Test files, slowest first (about 2.6 to 0.3 minutes each on 2 cores; measured from a
# full run's per-file sums, --junitxml). pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, pyproject.toml) hands whole files to its workers in
# collection order, a worker its next file when two of its tests are left; starting the
# long ones first lets the short ones fill in and the workers finish together. (xdist's
# default order, most tests first, started the files with a few long tests last; a list
# without test_serving.py, test_plan.py, test_serve.py and test_cluster_ray.py started
# those among the short files, and one worker finished about a minute after the other.)
# Files not named keep their order after these; a new file that takes more than about 20 s
# belongs here.
SLOWEST_FIRST = (
    "test_glide.py", "test_speculative.py", "test_serving.py", "test_train.py",
    "test_cluster_ray.py", "test_train_parallel.py", "test_plan.py", "test_serve.py",
    "test_combinations_train.py", "test_sequence_parallel.py", "test_recsys_train.py", "test_hetero_batches.py",
    "test_pipeline.py", "test_pipeline_uneven.py", "test_moe.py", "test_gpu_check.py", "test_offload_plan.py",
    "test_parallel.py", "test_notebook.py", "test_elastic_resize.py",
    "test_plan_bound.py", "test_offload.py", "test_gguf.py", "test_hf.py",
    "test_embedding_cache_training.py", "test_dlrm.py", "test_hetero_reduction.py", "test_offload_resume.py",
    "test_elastic_adascale.py", "test_explicit_sharding.py",
    "test_external_models.py", "test_serve_structured.py",
)


def pytest_configure(config):
    # Without this the workers' uid is xdist's own, which the controller never learns: it
    # removed a directory of its own name and left the workers' caches behind in /tmp.
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = _RUN_ID


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a serial run), once at the end
        shutil.rmtree(RUN_CACHES, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


def pytest_collection_finish(session):
    """Python's cyclic collector out of tracing's way. JAX's tracing and lowering make
    container objects by the million: test_decoding.py and test_dlrm.py ran 679 young,
    62 middle and 4 full collections (3.3 s of collecting; each full one walks the
    ~170,000 objects that JAX, Flax and the collected test modules hold). What collection
    imported is frozen out of the walks (``gc.freeze``, as ``jaxpar-serve`` does once
    started), and the young generation waits for 50,000 new objects instead of 700: 7
    collections, 0.4 s, the peak memory no higher (1.7 against 2.0 GB)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)


@pytest.fixture(autouse=True, scope="module")
def bounded_compiled_code():
    """Before a module, a worker holding many memory mappings drops the programs it has
    compiled (``jax.clear_caches``; modules load theirs again from the persistent cache).
    XLA:CPU maps each program's machine code (about 200 mappings per serving step
    program): past some 56,000 mappings, near Linux's ``vm.max_map_count`` of 65,530, a
    clean-clone CI run's worker segfaulted compiling (and once serializing) the serving
    engine's programs, with a null function pointer."""
    maps = pathlib.Path("/proc/self/maps")
    if maps.exists() and maps.read_text().count("\n") > 20_000:
        jax.clear_caches()
        gc.collect()
    yield


@contextlib.contextmanager
def lowerings(event: str = "/jax/core/compile/jaxpr_to_mlir_module_duration"):
    """The seconds of each program JAX lowers (traces to MLIR) in the block: ``[]`` when
    every program it ran was one already made. ``event``: another of JAX's compile
    durations to list instead (``/jax/core/compile/backend_compile_duration``: each XLA
    compile, a persistent-cache hit not among them)."""
    lowered = []

    def listen(name, duration, **_):
        if name == event:
            lowered.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def tree_rel_err(a, b) -> float:
    """The worst per-leaf ||a - b|| / ||b|| over two pytrees of the same structure. A leaf
    whose reference is all zeros counts ||a - b|| itself, and a NaN anywhere is inf: a
    0/0 must not drop out of the maximum (``max(0.0, nan)`` is 0.0)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        diff, norm = float(np.linalg.norm(x - y)), float(np.linalg.norm(y))
        err = diff / norm if norm > 0 else diff
        worst = max(worst, err if np.isfinite(err) else np.inf)
    return worst


def adasum_reference(grads):
    """Adasum of the replicas' gradients stacked ``[n, ...]`` on each leaf, in float64
    numpy (no program to compile, and none of ``jaxpar.hetero.adasum``'s code): the
    pairwise rule ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (a zero side's
    coefficient 1) over adjacent replicas, level by level (the module docstring)."""
    def pair(a, b):
        dot, aa, bb = np.vdot(a, b), np.vdot(a, a), np.vdot(b, b)
        return (1 - dot / (2 * aa) if aa > 0 else 1.0) * a + (1 - dot / (2 * bb) if bb > 0 else 1.0) * b

    def leaf(stacked):
        level = [np.asarray(g, np.float64) for g in stacked]
        while len(level) > 1:
            paired = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            level = paired + level[len(paired) * 2:]
        return level[0]

    return jax.tree.map(leaf, grads)


def random_init(build, rng, std: float = 0.3):
    """``build()``'s module with its parameters drawn by numpy (norm scales near 1, the
    rest, biases too, N(0, std^2)): nonzero everywhere, and no XLA random-number
    program to compile (on CPU that alone takes seconds per model)."""
    model = nnx.eval_shape(build)

    def draw(path, x):
        noise = rng.standard_normal(x.shape)
        scale = "scale" in jax.tree_util.keystr(path)
        # numpy casts and device_put places: jnp.asarray compiles a program per shape
        return jax.device_put(np.asarray(1 + 0.1 * noise if scale else std * noise).astype(x.dtype))

    nnx.update(model, jax.tree.map_with_path(draw, nnx.state(model)))
    return model


def train_processes(config: str, args: list[str], logs: pathlib.Path, *, processes: int = 2,
                    devices: int = 2) -> list[subprocess.Popen]:
    """``jaxpar-train CONFIG ARGS --no-progress`` as ``processes`` processes of ``devices``
    simulated CPU devices each on JAX's distributed runtime (gloo, a free port); process
    i's stderr in ``logs``.i (a file: a full pipe would stall the run)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(processes):
        with open(f"{logs}.{i}", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxpar.commands.train", config, *args, "--no-progress"],
                env=dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAXPAR_COORDINATOR=f"127.0.0.1:{port}",
                         JAXPAR_NUM_PROCESSES=str(processes), JAXPAR_PROCESS_ID=str(i)),
                stdout=subprocess.DEVNULL, stderr=log))
    return procs


def finish(procs: list[subprocess.Popen], logs: pathlib.Path, timeout: int = 600) -> None:
    """Waits for ``train_processes``' processes; each must exit 0 (else its log's tail)."""
    for i, proc in enumerate(procs):
        assert proc.wait(timeout=timeout) == 0, pathlib.Path(f"{logs}.{i}").read_text()[-2000:]


def kill_once_saved(procs: list[subprocess.Popen], run_dir: pathlib.Path, step: int, timeout: int = 600) -> list[int]:
    """SIGKILLs every process once ``run_dir`` holds the checkpoint of ``step`` (or one
    of them has ended); returns the steps saved by then."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not (run_dir / "checkpoints" / str(step)).is_dir() and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=60)
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def lazy_module(name: str):
    """``import name``, run on first attribute access (``importlib.util.LazyLoader``).
    pytest-xdist's workers each collect every test file, so a module a file imports at
    its top is imported by all three: ``openai`` (1.3 s) and ``scipy.stats`` (1.7 s)
    only where a test uses them."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_python(code: str, *, devices: int = 8, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with ``devices`` simulated CPU devices."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def train_steps(cfg, data, mesh=None, rules=None, *, prepare=lambda batch: batch, **step_options):
    """AdamW (1e-3, weight decay 0.1) steps of ``Transformer(cfg)`` (seed 0) over ``data``
    with ``make_train_step(..., **step_options)`` on ``mesh`` (rules: the model's for the
    mesh unless given); ``prepare`` maps each batch first. Returns ``(losses, params,
    opt_state)``."""
    import optax
    from flax import nnx

    from jaxpar.models import Transformer
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train.step import make_train_step

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if mesh is not None and rules is None:
        rules = sharding_rules(cfg, mesh)
    step = make_train_step(model, optax.adamw(1e-3, weight_decay=0.1), mesh, rules, **step_options)
    params, opt_state = step.init(model)
    losses = []
    for batch in data:
        params, opt_state, metrics = step(params, opt_state, prepare(batch))
        losses.append(float(metrics["loss"]))
    return losses, params, opt_state


@nnx.jit
def _forward(model, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def dense_logits(model, tokens, width: int) -> np.ndarray:
    """A ``Transformer``'s float32 logits ``[T, V]`` over one sequence ``tokens`` (no
    cache): one compiled forward over ``width`` tokens, right-padded (causal: the padding
    is unseen), so every length up to ``width`` shares the program where eager forwards
    would compile their ops for each length."""
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.array(_forward(model, padded)[0, :len(tokens)], np.float32)  # a writable copy


@nnx.jit
def _next_token_without_cache(model, tokens: jax.Array, at: jax.Array) -> jax.Array:
    return jnp.argmax(model(tokens)[:, at], axis=-1).astype(jnp.int32)


def greedy_without_cache(model, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Plain greedy decoding of a ``Transformer`` that recomputes the whole sequence each
    step: the oracle the cached decoders are tested against. ``prompt [B, P]``; returns
    ``[B, max_new_tokens]``. (The sequence is held in a buffer of its final length, so
    one compiled forward serves every step; causal attention keeps the unfilled tail
    from touching the filled head.)"""
    B, P = prompt.shape
    tokens = jnp.zeros((B, P + max_new_tokens), jnp.int32).at[:, :P].set(jnp.asarray(prompt, jnp.int32))
    for i in range(max_new_tokens):
        tokens = tokens.at[:, P + i].set(_next_token_without_cache(model, tokens, jnp.int32(P + i - 1)))
    return np.asarray(tokens[:, P:])


@pytest.fixture
def rng():
    return np.random.default_rng(0)
