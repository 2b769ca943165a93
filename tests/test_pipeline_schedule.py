"""Pipeline schedules as data (jaxpar.parallel.pipeline_schedule): every operation once, in
dependency order, with the bubble the formula predicts."""

import pytest

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
