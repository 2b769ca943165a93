"""Data-parallel serving: ``R`` engines, each with its own copy of the model, its own page
pool and its own devices, behind one engine's interface (what vLLM and SGLang call data
parallelism: independent engines, requests balanced between them).

``Replicas(engines)`` routes each request to the replica with the fewest unfinished
requests (the lowest index on a tie) and keeps it there; ``step`` steps every replica
that has work, concurrently (a thread each: JAX releases the interpreter lock while
a program runs, so the replicas' devices compute at once), and returns all their
changed outputs. A request's tokens are those its replica gives it, which are one
device's (each replica is an ``Engine``, tensor-parallel or not).

Separate engines rather than one program over a ``data`` axis: a replica's batch slots,
pages and admissions are its own, so one replica's long prompt or full pool never holds
the others back, and nothing crosses replicas in a step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxpar.serving import code_maps
from jaxpar.serving.engine import Engine
from jaxpar.serving.requests import RequestOutput, SamplingParams


@dataclasses.dataclass(frozen=True)
class PoolTotals:
    """Every replica's pages, summed: ``free`` and ``total``."""

    free: int
    total: int


class Replicas:
    """``engines`` (``Engine``s of one model, on disjoint devices) served as one."""

    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("Replicas needs at least one engine")
        self.engines = list(engines)
        first = self.engines[0]
        self.tokenizer, self.eos_ids = first.tokenizer, first.eos_ids
        self.max_context, self.page_size, self.draft = first.max_context, first.page_size, first.draft
        self.max_batch = sum(e.max_batch for e in self.engines)
        self._where: dict[str, Engine] = {}
        self._ids = itertools.count()
        self._threads = ThreadPoolExecutor(len(self.engines), thread_name_prefix="jaxpar-replica")

    # the Engine interface ------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams = SamplingParams(), request_id: str | None = None) -> str:
        """Queues a request on the least busy replica (``Engine.add_request``)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._where:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        engine = min(self.engines, key=lambda e: e.running + e.waiting)
        engine.add_request(prompt, params, request_id)
        self._where[request_id] = engine
        return request_id

    def abort(self, request_id: str) -> None:
        engine = self._where.pop(request_id, None)
        if engine is not None:
            engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines)

    @property
    def waiting(self) -> int:
        return sum(e.waiting for e in self.engines)

    @property
    def pool(self) -> PoolTotals:
        return PoolTotals(sum(e.pool.free for e in self.engines), sum(e.pool.total for e in self.engines))

    @property
    def rounds(self) -> int:
        return sum(e.rounds for e in self.engines)

    @property
    def accepted(self) -> int:
        return sum(e.accepted for e in self.engines)

    @property
    def preemptions(self) -> int:
        return sum(e.preemptions for e in self.engines)

    @property
    def prefix_queries(self) -> int:
        return sum(e.prefix_queries for e in self.engines)

    @property
    def prefix_hits(self) -> int:
        return sum(e.prefix_hits for e in self.engines)

    @property
    def compiled_programs(self) -> set[tuple]:
        """Each replica compiles the same shapes (on its own devices)."""
        return set().union(*(e.compiled_programs for e in self.engines))

    def describe_programs(self) -> str:
        return f"{len(self.engines)} replicas' {self.engines[0].describe_programs()}"

    def warm_up_programs(self) -> list:
        """Every replica's programs (``Engine.warm_up_programs``)."""
        return [call for e in self.engines for call in e.warm_up_programs()]

    def warm_up(self, report=None, *, background: bool = False) -> None:
        """Every replica compiles its programs, at once (``report`` is called from their
        threads), once their code is known to fit the process's memory-map limit
        together (``Engine.warm_up``)."""
        code_maps.check_code_mappings(sum(len(e.warm_up_programs()) for e in self.engines),
                                      platform=jax.default_backend(),
                                      maps_per_program=max(e.maps_per_program for e in self.engines))
        list(self._threads.map(lambda e: e.warm_up(report, check_maps=False, background=background), self.engines))

    def wait_warm_up(self, timeout: float | None = None) -> bool:
        return all([e.wait_warm_up(timeout) for e in self.engines])

    def stop_warm_up(self) -> None:
        for e in self.engines:
            e.stop_warm_up()

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, at once; their changed outputs."""
        busy = [e for e in self.engines if e.has_unfinished()]
        outputs = [o for changed in self._threads.map(lambda e: e.step(), busy) for o in changed]
        for output in outputs:
            if output.finished:
                self._where.pop(output.request_id, None)
        return outputs

    def output(self, request_id: str) -> RequestOutput:
        return self._where[request_id].output(request_id)

    # Engine.generate needs only add_request, output, has_unfinished and step
    generate = Engine.generate
