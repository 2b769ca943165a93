"""Pipeline schedules as data (jaxpar.parallel.pipeline_schedule): every operation once, in
dependency order, with the bubble the formula predicts; and the pipeline's plan of its
buffer slots (jaxpar.parallel.pipeline.plan), on the host, nothing compiled."""

import numpy as np
import pytest

from jaxpar.parallel.pipeline import plan
from jaxpar.parallel.pipeline_schedule import BACKWARD, FORWARD, IDLE, build

CASES = [("gpipe", P, M, 1) for P, M in [(2, 2), (2, 4), (4, 4), (4, 8), (4, 5)]] + \
        [("1f1b", P, M, 1) for P, M in [(2, 2), (2, 3), (4, 4), (4, 8), (4, 7), (4, 16)]] + \
        [("interleaved", P, M, 2) for P, M in [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)]]


@pytest.mark.parametrize("kind,P,M,V", CASES)
def test_schedule_is_complete_ordered_and_has_the_theoretical_bubble(kind, P, M, V):
    s = build(kind, P, M, V)
    S = P * V
    when = {}
    for t in range(s.ticks):
        for p in range(P):
            op, m, stage = s.op[t, p], s.microbatch[t, p], s.stage[t, p]
            if op == IDLE:
                continue
            assert stage % P == p  # circular assignment of stages to devices
            assert (op, m, stage) not in when
            when[op, m, stage] = t
    assert len(when) == 2 * M * S
    for m in range(M):
        for stage in range(S):
            if stage:
                assert when[FORWARD, m, stage - 1] < when[FORWARD, m, stage]
            after = when[FORWARD, m, stage] if stage == S - 1 else when[BACKWARD, m, stage + 1]
            assert after < when[BACKWARD, m, stage]
    assert s.bubble() == pytest.approx(s.bubble_theory(), abs=1e-12)


def test_1f1b_keeps_at_most_p_microbatches_where_gpipe_keeps_m():
    P, M = 4, 16
    assert build("gpipe", P, M).in_flight().tolist() == [M] * P
    assert build("1f1b", P, M).in_flight().tolist() == [P - p for p in range(P)]
    # Interleaved (V = 2): Megatron's warm-up 2 (P - p - 1) + (V - 1) P, plus one; each a
    # virtual stage's activations, 1/V of a device's layers.
    assert build("interleaved", P, M, 2).in_flight().tolist() == [2 * (P - p - 1) + P + 1 for p in range(P)]


@pytest.mark.parametrize("args,message", [
    (("1f1b", 4, 3), "1f1b needs at least as many microbatches as pipeline stages: microbatches=3 < pipe=4"),
    (("interleaved", 4, 6, 2), "interleaved needs the microbatches divisible by the pipeline size: microbatches=6, pipe=4"),
    (("gpipe", 4, 8, 2), "virtual stages (2) need the interleaved schedule"),
    (("zero", 4, 8), "pipeline schedule 'zero' is not one of"),
])
def test_bad_sizes_name_the_numbers(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(*args)


# The plan: the schedule's buffer slots, worked out on the host ------------------------

def test_plan_of_gpipe_on_two_devices_by_hand():
    """P = 2, M = 2: device 0 stashes microbatches 0, 1 in slots 0, 1; device 1 reads
    each arrival from receive slot 0 (freed by its read before the next arrives); the
    gradients reach device 0 in its receive slot 0 at ticks 3 and 4."""
    p = plan(build("gpipe", 2, 2))
    assert p.op.tolist() == [[1, 0], [1, 1], [0, 1], [0, 2], [2, 2], [2, 0]]
    assert p.microbatch.tolist() == [[0, 0], [1, 0], [0, 1], [0, 0], [0, 1], [1, 0]]  # 0 when idle
    assert p.virtual.tolist() == [[0, 0]] * 6
    assert p.slot.tolist() == [[0, -1], [1, 0], [-1, 1], [-1, 0], [0, 1], [1, -1]]
    assert p.read.tolist() == [[-1, -1], [-1, 0], [-1, 0], [-1, -1], [0, -1], [0, -1]]
    assert p.arrive_f.tolist() == [[-1, 0], [-1, 0], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert p.arrive_b.tolist() == [[-1, -1], [-1, -1], [-1, -1], [0, -1], [0, -1], [-1, -1]]
    assert p.any_forward.tolist() == [True, True, True, False, False, False]
    assert p.any_backward.tolist() == [False, False, False, True, True, True]
    assert p.head_forward.tolist() == [False, True, True, False, False, False]
    assert p.head_backward.tolist() == [False, False, False, True, True, False]
    assert p.sends_f.tolist() == [True, True, False, False, False, False]
    assert p.sends_b.tolist() == [False, False, False, True, True, False]
    assert (p.stash_size, p.recv_f_size, p.recv_b_size) == (2, 1, 1)


@pytest.mark.parametrize("kind,P,M,V", CASES)
def test_plan_routes_every_value_to_its_reader(kind, P, M, V):
    """The plan's tables replayed with labels for buffer contents: every operation reads
    the value it needs from the slot the plan names, no slot is written while its value
    waits to be read, every buffer ends empty, and the per-tick flags agree with the
    per-device tables."""
    s, p = build(kind, P, M, V), plan(build(kind, P, M, V))
    S = P * V
    stash, recv = [{} for _ in range(P)], {"f": [{} for _ in range(P)], "b": [{} for _ in range(P)]}
    sizes = {"f": p.recv_f_size, "b": p.recv_b_size}
    arrive = {"f": p.arrive_f, "b": p.arrive_b}
    for t in range(s.ticks):
        sent = []
        for d in range(P):
            op, m, stage = s.op[t, d], s.microbatch[t, d], s.stage[t, d]
            assert p.op[t, d] == op
            if op == IDLE:
                assert p.slot[t, d] == p.read[t, d] == -1
                continue
            assert (p.microbatch[t, d], p.virtual[t, d]) == (m, stage // P)
            assert (p.first[t, d], p.last[t, d]) == (stage == 0, stage == S - 1)
            slot, read = p.slot[t, d], p.read[t, d]
            if op == FORWARD:
                if stage > 0:
                    assert recv["f"][d].pop(read) == ("out", m, stage - 1)
                else:
                    assert read == -1
                assert 0 <= slot < p.stash_size and slot not in stash[d]
                stash[d][slot] = ("in", m, stage)
                if stage < S - 1:
                    sent.append(("f", (d + 1) % P, ("out", m, stage)))
            else:
                assert stash[d].pop(slot) == ("in", m, stage)
                if stage < S - 1:
                    assert recv["b"][d].pop(read) == ("grad", m, stage + 1)
                else:
                    assert read == -1
                if stage > 0:
                    sent.append(("b", (d - 1) % P, ("grad", m, stage)))
        for way in "fb":
            to = sorted(to for w, to, _ in sent if w == way)
            assert to == np.flatnonzero(arrive[way][t] >= 0).tolist()
        for way, to, value in sent:
            slot = arrive[way][t, to]
            assert 0 <= slot < sizes[way] and slot not in recv[way][to]
            recv[way][to][slot] = value
        assert p.any_forward[t] == (s.op[t] == FORWARD).any() and p.any_backward[t] == (s.op[t] == BACKWARD).any()
        last = s.stage[t] == S - 1
        assert p.head_forward[t] == (last & (s.op[t] == FORWARD)).any()
        assert p.head_backward[t] == (last & (s.op[t] == BACKWARD)).any()
        assert p.sends_f[t] == any(w == "f" for w, _, _ in sent) and p.sends_b[t] == any(w == "b" for w, _, _ in sent)
    assert not any(stash) and not any(recv["f"]) and not any(recv["b"])
