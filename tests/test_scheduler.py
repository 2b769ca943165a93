"""The serving scheduler (jaxpar.serving.scheduler) against hand-computed steps: what runs,
with how many tokens, which pages it holds, whom a dry pool preempts, and the prefix
cache keeping a preempted sequence's full pages."""

from jaxpar.serving.page_pool import PagePool, page_keys
from jaxpar.serving.scheduler import Scheduler, Seq


def scheduler(pages=9) -> Scheduler:
    """Pages of 4 tokens, 8 in the pool, a budget of 16 tokens, 2 prompts per step."""
    return Scheduler(PagePool(pages), page_size=4, max_pages=8, max_batch=4, max_num_batched_tokens=16,
                     max_prefills=2)


def apply(s: Scheduler, plan) -> None:
    """What the engine does after a step: the tokens computed, a token sampled (0) for
    every decode row and every prompt whose last chunk ran."""
    for seq in plan.decode:
        s.computed(seq, 1)
        seq.tokens.append(0)
    for seq, n in plan.chunks:
        s.computed(seq, n)
        if seq.remaining == 0:
            seq.tokens.append(0)


def shape(plan):
    return ([q.request_id for q in plan.decode], [(q.request_id, n) for q, n in plan.chunks], plan.rows,
            plan.tokens)


def test_steps_admit_chunk_decode_and_preempt_the_newest():
    s = scheduler()
    assert s.token_buckets == (8, 16) and s.rows_buckets == () and s.shapes() == [("step", 8), ("step", 16)]
    a, b, c = (Seq(name, list(range(start, start + n)), n) for name, start, n in (("a", 1, 10), ("b", 20, 5),
                                                                                   ("c", 30, 3)))
    s.waiting.extend([a, b, c])

    # 1: a's 10 prompt tokens (3 pages), b's 5 (2 pages); 2 prompts per step: c waits
    plan = s.schedule()
    assert shape(plan) == ([], [("a", 10), ("b", 5)], 0, 16)
    assert (len(a.pages), len(b.pages), s.pool.free, list(s.waiting)) == (3, 2, 3, [c])
    apply(s, plan)
    assert (a.registered, b.registered) == (2, 1)  # full pages keyed

    # 2: a and b decode (a token each in the flat batch), c admitted (1 page): 5 tokens in the 8 bucket
    plan = s.schedule()
    assert shape(plan) == (["a", "b"], [("c", 3)], 0, 8) and s.pool.free == 2
    apply(s, plan)
    # 3: all three decode in their pages; 4: a and c each take a page, the pool is dry
    assert shape(plan := s.schedule()) == (["a", "b", "c"], [], 0, 8) and s.pool.free == 2
    apply(s, plan)
    assert shape(plan := s.schedule()) == (["a", "b", "c"], [], 0, 8) and s.pool.free == 0
    apply(s, plan)

    # 5: b needs a third page: c, the newest and not yet scheduled, is preempted; its
    # full page stays cached, but readmitting it needs one more page than is free
    plan = s.schedule()
    assert shape(plan) == (["a", "b"], [], 0, 8) and s.preemptions == 1
    assert list(s.waiting) == [c] and (c.pages, c.computed, c.tokens) == ([], 0, [30, 31, 32, 0, 0, 0])
    assert s.pool.free == 1 and s.pool.cached_run(page_keys(c.tokens, 4, 1)) == 1


def test_a_cached_prefix_is_shared_and_a_twin_waits_for_the_pages_being_computed():
    s = scheduler(pages=17)
    prompt = list(range(1, 14))  # 13 tokens: 3 full pages, the last token left to sample
    first, twin = Seq("first", list(prompt), 13), Seq("twin", list(prompt), 13)
    s.waiting.extend([first, twin])
    plan = s.schedule()  # the twin's first page is being computed by the first: it waits
    assert shape(plan) == ([], [("first", 13)], 0, 16) and list(s.waiting) == [twin]
    apply(s, plan)
    plan = s.schedule()  # now it shares the 3 full pages and prefills 1 token
    assert shape(plan) == (["first"], [("twin", 1)], 0, 8)
    assert twin.pages[:3] == first.pages[:3] and twin.cached_tokens == 12
    assert (s.prefix_queries, s.prefix_hits) == (26, 12)
    s.finish(first)
    s.finish(twin)
    assert s.pool.free == s.pool.total and s.pool.cached == 3  # the shared pages stay cached


def test_buckets_at_the_servers_defaults_with_and_without_a_draft():
    """A 256-token budget: steps of 8-256 tokens without a draft; with one (gamma 4: 5
    tokens a row), steps carry prompt chunks only, in powers of 4 from 16, and rounds of
    1, 4, 16 and 51 rows (51 rounds of 5 tokens fit the budget)."""
    make = lambda draft: Scheduler(PagePool(9), page_size=16, max_pages=512, max_batch=64,  # noqa: E731
                                   max_num_batched_tokens=256, max_prefills=8, tokens_per_row=5 if draft else 1,
                                   draft=draft)
    plain, drafted = make(False), make(True)
    assert plain.token_buckets == (8, 16, 32, 64, 128, 256) and plain.rows_buckets == ()
    assert drafted.token_buckets == (16, 64, 256) and drafted.rows_buckets == (1, 4, 16, 51)
    assert len(drafted.shapes()) == 7


def test_steps_stay_within_the_programs_compiled_so_far():
    """While warm-up compiles in the background (``ready``): without a draft only the
    8-token step compiled caps a step at 8 tokens, decode rows first, the rest waiting;
    with a draft (gamma 2: 3 tokens a row) only the 1-row round and the 8-token step, a
    step runs one sequence's round and 8 prompt tokens; all compiled (None), the whole
    budget again."""
    s = scheduler()
    s.ready = frozenset({("step", 8)})
    a, b = Seq("a", list(range(1, 11)), 10), Seq("b", list(range(20, 25)), 5)
    s.waiting.extend([a, b])
    assert shape(plan := s.schedule()) == ([], [("a", 8)], 0, 8)  # not a's 10 and b's 5 in a 16-token step
    apply(s, plan)
    assert shape(plan := s.schedule()) == ([], [("a", 2), ("b", 5)], 0, 8)
    apply(s, plan)
    s.ready = None
    assert shape(s.schedule()) == (["a", "b"], [], 0, 8)

    def drafted(ready):
        d = Scheduler(PagePool(17), page_size=4, max_pages=8, max_batch=4, max_num_batched_tokens=16,
                      max_prefills=2, tokens_per_row=3, draft=True)
        assert d.token_buckets == (8, 16) and d.rows_buckets == (1, 4)
        d.ready = ready
        for name, start in (("x", 1), ("y", 11)):  # prompts computed, a token generated: a round's turn
            seq = Seq(name, list(range(start, start + 6)), 5)
            seq.pages, seq.computed, seq.order = d.pool.take(2), 5, next(d._order)
            d.running.append(seq)
        d.waiting.append(Seq("z", list(range(21, 31)), 10))
        return d.schedule()

    # x's round and 8 of z's tokens; y's round and z's last 2 tokens wait
    assert shape(drafted(frozenset({("step", 8), ("round_step", 1)}))) == (["x"], [("z", 8)], 1, 8)
    assert shape(drafted(None)) == (["x", "y"], [("z", 10)], 4, 16)
