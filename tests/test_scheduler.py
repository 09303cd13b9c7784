"""The scheduler's admission and prefill policy, on plain data (no MLX, no server)."""

from __future__ import annotations

import pytest

from servicer.admission import Admission, MemoryModel
from servicer.engine.prefill import (
    BULK_DECODE_STEPS,
    IDLE_STEP_FLOOR_S,
    STALL_DECODE_STEPS,
    DecodeCost,
    PrefillCost,
    PrefillPolicy,
    PrefillRow,
    PrefillSample,
    Widening,
    can_join,
    chunk_for,
    step_budget,
    step_capacity,
)
from servicer.engine.scheduler import BatchView, Scheduler
from servicer.messages import GenerationRequest

# 1 KiB per token, allocated one token at a time: a request costs (prompt + max_tokens) KiB.
ADMISSION = Admission(MemoryModel(((1024, None),), 0, allocation_step=1), limit_bytes=100 * 1024)
IDLE = BatchView(rows=0, first_tokens_due=False)


def _request(ticket: int, tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(ticket, f"r{ticket}", [1] * (tokens // 2), tokens - tokens // 2)


# Without a prefill budget (the old policy): everything that fits memory, full chunks.


def test_admits_in_arrival_order_while_memory_lasts():
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1, 40), _request(2, 40), _request(3, 40)])
    admits = scheduler.schedule(IDLE).admits
    assert [a.request.ticket for a in admits] == [1, 2]
    assert sum(a.reserved for a in admits) == 80 * 1024 and scheduler.waiting == 1
    full = BatchView(rows=2, first_tokens_due=False, reserved=80 * 1024)
    assert scheduler.schedule(full).admits == []  # 3 waits
    one_left = BatchView(rows=1, first_tokens_due=False, reserved=admits[1].reserved)
    assert [a.request.ticket for a in scheduler.schedule(one_left).admits] == [3]


@pytest.mark.parametrize("max_stall_s", [0, 0.05])
def test_the_plan_caps_prompts_in_prefill_and_rows_with_the_budget_on_or_off(max_stall_s):
    """One gate: the runner admits whatever the plan says, so the plan alone keeps a model
    whose layers read padding (prefill_rows: 1) to one prompt at a time, and the batch to
    `max_rows` (--completion-batch-size), whatever the prefill budget."""
    roomy = Admission(ADMISSION.memory, limit_bytes=10_000 * 1024)
    one_at_a_time = Scheduler(roomy, PrefillPolicy(max_stall_s=max_stall_s, max_rows=1))
    one_at_a_time.enqueue([_request(i, 8) for i in range(1, 4)])
    assert [a.request.ticket for a in one_at_a_time.schedule(IDLE).admits] == [1]
    prefilling = BatchView(rows=1, first_tokens_due=False, prefilling=(PrefillRow(5, 0),))
    assert one_at_a_time.schedule(prefilling).admits == []  # 1 is still in prefill
    decoding = BatchView(rows=1, first_tokens_due=False)
    assert [a.request.ticket for a in one_at_a_time.schedule(decoding).admits] == [2]

    two_slots = Scheduler(roomy, PrefillPolicy(max_stall_s=max_stall_s, max_rows=8), max_rows=2)
    two_slots.enqueue([_request(i, 8) for i in range(1, 5)])
    assert [a.request.ticket for a in two_slots.schedule(IDLE).admits] == [1, 2]
    full = BatchView(rows=2, first_tokens_due=False)
    assert two_slots.schedule(full).admits == []  # 3 waits for a slot
    assert two_slots.waiting == 2


def test_a_request_alone_is_admitted_even_past_the_limit():
    # The handler refuses what could never fit; past the limit alone means nothing runs.
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1, 150)])
    assert [a.request.ticket for a in scheduler.schedule(IDLE).admits] == [1]


def test_nothing_is_admitted_while_a_first_token_is_due():
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1)])
    assert scheduler.schedule(BatchView(rows=1, first_tokens_due=True)).admits == []
    assert len(scheduler.schedule(BatchView(rows=1, first_tokens_due=False)).admits) == 1


def test_withdraw_and_drain():
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1), _request(2), _request(3)])
    assert scheduler.withdraw({2, 9}) == [2]
    admitted = scheduler.schedule(BatchView(rows=0, first_tokens_due=False)).admits
    assert [a.request.ticket for a in admitted] == [1, 3]
    scheduler.enqueue([_request(4)])
    assert scheduler.drain() == [4] and scheduler.waiting == 0


def test_an_idle_engine_expects_as_many_as_ended_together_at_most_a_prefill_batch():
    scheduler = Scheduler(ADMISSION, PrefillPolicy(max_stall_s=0.05, max_rows=4))
    assert scheduler.burst == 4  # nothing ran yet: a first wave
    scheduler.emptied(1)
    assert scheduler.burst == 1  # a lone request after a lone one: no wait
    scheduler.emptied(9)
    assert scheduler.burst == 4
    scheduler.emptied(0)  # the batch failed: nobody is expected back
    assert scheduler.burst == 0


# With a prefill budget.

POLICY = PrefillPolicy(max_stall_s=0.05, step_tokens=2048, max_rows=8, min_chunk=32)
BIG = Admission(MemoryModel(((1, None),), 0, allocation_step=1), limit_bytes=1 << 40)


def _prompt(ticket: int, tokens: int) -> GenerationRequest:
    return GenerationRequest(ticket, f"p{ticket}", [1] * tokens, 16)


def _budgeted(cost: PrefillCost | None = None) -> Scheduler:
    scheduler = Scheduler(BIG, POLICY)
    if cost is not None:
        scheduler.cost = cost
    return scheduler


def _linear_cost(per_token_s: float) -> PrefillCost:
    cost = PrefillCost()
    for n in (64, 128, 256, 512, 1024) * 4:
        cost.observe(PrefillSample(1, n, 0, per_token_s * n))
    return cost


def test_the_cost_model_learns_a_linear_and_an_attention_term():
    cost = PrefillCost()
    for n, c in [(64, 0), (512, 0), (128, 2000), (1024, 3000), (256, 500), (32, 3900)] * 5:
        cost.observe(PrefillSample(1, n, c, 0.002 + 3e-4 * n + 1e-8 * n * (c + n / 2)))
    assert abs(cost.seconds(1, 300, 1000) - (0.002 + 3e-4 * 300 + 1e-8 * 300 * 1150)) < 2e-3
    assert cost.tokens_within(0.05, 3000) < cost.tokens_within(0.05, 0)  # context costs
    assert cost.tokens_within(0.001, 0) == 0  # less than the fixed part


def test_the_decode_estimate_starts_at_the_first_step_and_follows_the_batch_as_it_grows():
    cost = DecodeCost()
    assert cost.seconds(4) == 0.0
    cost.observe(2, 0.25)  # no climb from zero: the first step is the estimate
    assert abs(cost.seconds(2) - 0.25) < 1e-3
    for _ in range(3):
        cost.observe(2, 0.25)
    # Eight rows join (a compute-bound model: 0.05 s a row): the next step's estimate is
    # near the truth after one step at the new size, where an average would lag for many.
    cost.observe(8, 0.55)
    assert abs(cost.seconds(8) - 0.55) < 0.05 and abs(cost.seconds(2) - 0.25) < 0.05
    for _ in range(10):
        cost.observe(8, 0.55)
    assert abs(cost.seconds(8) - 0.55) < 1e-3


def test_the_decode_estimate_ignores_noise_that_would_make_more_rows_cheaper():
    cost = DecodeCost()
    cost.observe(1, 0.30)
    cost.observe(8, 0.20)
    assert cost.seconds(1) == cost.seconds(32) > 0.2
    cost.observe(4, float("nan"))
    cost.observe(0, 1.0)
    assert cost.seconds(1) == cost.seconds(32) < 0.3


def test_one_slow_step_moves_the_decode_estimate_a_little_and_a_real_change_soon():
    cost = DecodeCost()
    for _ in range(5):
        cost.observe(4, 0.01)
    cost.observe(4, 1.0)  # the process paused
    assert cost.seconds(4) < 0.02
    for _ in range(6):  # the steps really got 20x slower (a throttled machine)
        cost.observe(4, 0.2)
    assert cost.seconds(4) > 0.1


def test_idle_steps_prefill_full_chunks_and_decoding_steps_what_fits_the_budget():
    cost = _linear_cost(5e-4)  # 100 tokens in 50 ms
    budget = step_budget(POLICY, 1.0, 0.0)
    assert step_capacity(POLICY, cost, False, 0, budget) == 2048
    assert 90 <= step_capacity(POLICY, cost, True, 0, budget) <= 100
    # a slow model: prefill keeps at least three decode steps (each call also costs about one)
    assert step_budget(POLICY, 1.0, decode_step_s=0.2) == pytest.approx(0.6)
    assert step_capacity(POLICY, cost, True, 0, step_budget(POLICY, 1.0, 0.2)) >= 1190
    assert step_capacity(PrefillPolicy(max_stall_s=0), cost, True, 0, 0.0) == 2048


def test_first_tokens_due_next_step_take_their_share_of_the_budget():
    cost = PrefillCost()
    for n, f in [(64, 0), (128, 2), (256, 0), (32, 4), (512, 1), (0, 3)] * 5:
        cost.observe(PrefillSample(1 if n else 0, n, 0, 0.001 + 5e-4 * n + 0.004 * f, f))
    alone = step_capacity(POLICY, cost, True, 0, 0.05)
    beside = step_capacity(POLICY, cost, True, 0, 0.05, starting=4)
    assert 85 <= alone <= 100 and beside < alone - 25  # four first tokens cost 16 ms


def test_a_long_prompt_is_split_while_rows_decode():
    scheduler = _budgeted(_linear_cost(5e-4))
    scheduler.enqueue([_prompt(1, 4000)])
    decoding = BatchView(rows=4, first_tokens_due=False)
    choice = scheduler.schedule(decoding)
    assert [a.request.ticket for a in choice.admits] == [1]
    assert 32 <= choice.chunk <= 100
    in_prefill = BatchView(5, False, (PrefillRow(3999 - choice.chunk, choice.chunk),))
    assert scheduler.schedule(in_prefill).chunk <= 100


def test_the_oldest_prompt_goes_first_and_short_ones_squeeze_in_beside_it():
    scheduler = _budgeted(_linear_cost(5e-4))
    scheduler.enqueue([_prompt(1, 3000), _prompt(2, 3000), _prompt(3, 20), _prompt(4, 30)])
    first = scheduler.schedule(BatchView(rows=2, first_tokens_due=False))
    # 1 starts; 2 is long and waits for 1; 3 finishes within half the step beside 1; 4 would
    # leave the long prompt less than half the step
    assert [a.request.ticket for a in first.admits] == [1, 3]
    later = scheduler.schedule(BatchView(3, False, (PrefillRow(2900, 100),)))
    assert [a.request.ticket for a in later.admits] == [4]
    assert scheduler.waiting == 1  # 2 waits until 1 is through


def test_idle_prompts_arriving_together_start_a_few_at_a_time_oldest_first():
    scheduler = _budgeted()
    scheduler.enqueue([_prompt(t, 1000) for t in range(1, 9)])
    choice = scheduler.schedule(BatchView(rows=0, first_tokens_due=False))
    assert [a.request.ticket for a in choice.admits] == [1, 2]  # 2 x 1000 fit a 2048 chunk
    assert choice.chunk == 999


def test_chunks_and_joining_rules():
    assert chunk_for([], 500, 32) == 500
    assert chunk_for([3000], 500, 32) == 500
    assert chunk_for([3000, 10], 500, 32) == 250
    assert chunk_for([5, 10], 500, 32) == 32  # at least the minimum
    assert can_join([], 400, 500, 32)
    assert can_join([3000], 200, 500, 32) and not can_join([3000], 300, 500, 32)
    assert not can_join([3000, 10], 100, 500, 32)  # the long one would keep a third
    assert can_join([10, 20], 100, 500, 32)  # all finish this step


def test_short_prompts_that_fit_start_together_while_rows_decode():
    scheduler = _budgeted(_linear_cost(1e-4))  # 500 tokens in 50 ms
    scheduler.enqueue([_prompt(t, 90) for t in range(1, 8)])
    choice = scheduler.schedule(BatchView(rows=4, first_tokens_due=False))
    # prompts of 89 tokens to prefill: five or six fit one call of about 500 padded tokens
    assert [a.request.ticket for a in choice.admits][:5] == [1, 2, 3, 4, 5]
    assert choice.chunk == 89  # one call: each of them finishes in it


def test_the_budget_widens_while_a_line_is_queued_and_narrows_when_it_drains():
    policy = PrefillPolicy(max_stall_s=0.05, max_widen=4.0)
    widening = Widening()
    assert widening.update(policy, waiting=1, oldest_wait_s=0.0) == 1.0  # one arrival
    factors = [widening.update(policy, waiting=2 + i, oldest_wait_s=0.0) for i in range(10)]
    assert factors == sorted(factors) and factors[-1] == 4.0  # step by step, up to the cap
    assert widening.update(policy, waiting=5, oldest_wait_s=0.0) == 4.0  # holds while queued
    narrowing = [widening.update(policy, waiting=0, oldest_wait_s=0.0) for _ in range(10)]
    assert narrowing == sorted(narrowing, reverse=True) and narrowing[-1] == 1.0
    # a prompt waiting several budgets is a queue too, even when the line is not growing
    assert widening.update(policy, waiting=1, oldest_wait_s=0.5) > 1.0
    assert Widening().update(PrefillPolicy(max_widen=1.0), 9, 9.0) == 1.0  # switched off


def test_a_queue_widens_what_a_step_may_prefill():
    scheduler = _budgeted(_linear_cost(5e-4))  # 100 tokens in 50 ms
    decoding = BatchView(rows=4, first_tokens_due=False)
    scheduler.enqueue([_prompt(1, 90)], now=0.0)
    first = scheduler.schedule(decoding, now=0.01)
    scheduler.enqueue([_prompt(t, 90) for t in range(2, 40)], now=0.02)
    later = [scheduler.schedule(decoding, now=1.0 + i) for i in range(8)]
    assert len(first.admits) == 1 and not first.widened
    assert len(later[-1].admits) >= 3 and later[-1].widened
    assert later[-1].budget_s == 0.2  # 4 x 50 ms


def test_while_widened_new_prompts_wait_out_a_step_whose_first_tokens_are_due():
    scheduler = _budgeted(_linear_cost(1e-4))  # 500 tokens in 50 ms
    decoding = BatchView(rows=8, first_tokens_due=False)
    starting = BatchView(rows=8, first_tokens_due=False, starting=3)
    scheduler.enqueue([_prompt(1, 90)], now=0.0)
    assert len(scheduler.schedule(starting, now=0.001).admits) == 1  # no queue: at once
    scheduler.enqueue([_prompt(t, 90) for t in range(2, 30)], now=0.002)
    assert scheduler.schedule(starting, now=0.003).admits == []  # a queue: they gather...
    assert scheduler.widening.factor > 1.0
    assert len(scheduler.schedule(decoding, now=0.004).admits) >= 4  # ...and start together


def test_planning_and_the_over_budget_count_use_the_same_budget():
    scheduler = _budgeted(_linear_cost(5e-4))
    scheduler.enqueue([_prompt(1, 4000)])
    slow = BatchView(rows=4, first_tokens_due=False, decode_step_s=0.3)  # a slow model
    choice = scheduler.schedule(slow)
    planned = scheduler.cost.seconds(1, choice.chunk, 0)
    assert planned <= choice.budget_s == pytest.approx(STALL_DECODE_STEPS * 0.3)
    assert not scheduler.over_budget(PrefillSample(1, choice.chunk, 0, planned), choice)
    late = choice.budget_s + 0.01
    assert scheduler.over_budget(PrefillSample(1, choice.chunk, 0, late), choice)


def test_without_a_budget_nothing_widens_and_nothing_is_held_back():
    scheduler = Scheduler(ADMISSION, PrefillPolicy(max_stall_s=0, max_widen=4.0))
    starting = BatchView(rows=1, first_tokens_due=False, starting=1)
    for step in range(6):  # a line that keeps growing and waiting
        scheduler.enqueue([_request(10 * step + i, 4) for i in range(3)], now=0.0)
        admits = scheduler.schedule(starting, now=float(step)).admits
        assert admits, f"step {step}: admission held back with the budget off"
    assert scheduler.widening.factor == 1.0


def test_a_line_held_back_by_memory_does_not_widen():
    scheduler = Scheduler(ADMISSION, POLICY)
    scheduler.cost = _linear_cost(5e-4)
    scheduler.enqueue([_prompt(1, 40)], now=0.0)
    (admit,) = scheduler.schedule(IDLE, now=0.0).admits  # 56 of the 100 KiB
    decoding = BatchView(rows=1, first_tokens_due=False, reserved=admit.reserved)
    for step in range(8):  # more arrive and wait, for memory alone
        scheduler.enqueue([_prompt(100 + step, 40)], now=0.1 * step)
        assert scheduler.schedule(decoding, now=1.0 + step).admits == []
    assert scheduler.widening.factor == 1.0


def _memory_bound_cost() -> PrefillCost:
    """A prefill call reads all the weights (100 ms) before its 3 ms a token: the real model
    on this CPU, whose decode step takes about 230 ms for 1 row as for 8."""
    cost = PrefillCost()
    for n in (8, 16, 32, 64, 128, 256) * 4:
        cost.observe(PrefillSample(1, n, 0, 0.1 + 0.003 * n))
    return cost


def test_on_a_memory_bound_model_a_short_prompt_is_prefilled_in_one_call():
    scheduler = _budgeted(_memory_bound_cost())
    scheduler.enqueue([_prompt(1, 129)])
    decoding = BatchView(rows=7, first_tokens_due=False, decode_step_s=0.23)
    choice = scheduler.schedule(decoding)
    # Split to fit one decode step it took three calls, three weight reads.
    assert [a.request.ticket for a in choice.admits] == [1]
    assert choice.chunk == 128
    assert choice.budget_s > 0.23  # planned past the base budget, so not over it


def test_a_long_prompt_under_way_ends_within_the_budget_not_past_it():
    # 300 tokens left (the budget fits ~150): a prompt that has not begun takes them in one
    # call past the budget; one that has prefilled for many steps takes the budget's share
    # and ends a step later, so its last step leaves the streams no longer a gap than others.
    scheduler = _budgeted(_memory_bound_cost())
    fresh = (PrefillRow(300, 0),)
    choice = scheduler.schedule(BatchView(8, False, fresh, decode_step_s=0.23))
    assert choice.chunk == 300 and choice.budget_s > STALL_DECODE_STEPS * 0.23
    under_way = (PrefillRow(300, 7000, progressed=True),)
    choice = scheduler.schedule(BatchView(8, False, under_way, decode_step_s=0.23))
    assert 32 <= choice.chunk < 300
    assert choice.budget_s == pytest.approx(STALL_DECODE_STEPS * 0.23)


def test_on_a_memory_bound_model_prompts_waiting_together_share_one_call():
    scheduler = _budgeted(_memory_bound_cost())
    scheduler.enqueue([_prompt(1, 65), _prompt(2, 65)])
    decoding = BatchView(rows=6, first_tokens_due=False, decode_step_s=0.23)
    choice = scheduler.schedule(decoding)
    assert [a.request.ticket for a in choice.admits] == [1, 2]
    assert choice.chunk == 64


def test_on_a_fast_model_the_allowance_leaves_a_long_prompt_split():
    scheduler = _budgeted(_linear_cost(5e-4))
    scheduler.enqueue([_prompt(1, 400)])
    choice = scheduler.schedule(BatchView(rows=4, first_tokens_due=False, decode_step_s=0.003))
    assert 32 <= choice.chunk <= 110


def test_on_a_memory_bound_model_a_burst_as_large_as_the_batch_is_prefilled_whole():
    scheduler = _budgeted(_memory_bound_cost())
    scheduler.enqueue([_prompt(t, 129) for t in range(1, 25)])
    # 8 rows just started decoding, 24 prompts wait: one call takes the next 8, as if idle.
    choice = scheduler.schedule(BatchView(rows=8, first_tokens_due=False, decode_step_s=0.23))
    assert [a.request.ticket for a in choice.admits] == list(range(1, 9))
    assert choice.chunk == 128 and choice.bulk  # every one of them finishes in the call
    assert not scheduler.over_budget(PrefillSample(8, 128, 0, 3.0), choice)


def test_a_bulk_step_of_long_prompts_stays_within_its_decode_steps():
    """Long prompts queueing on a slow model: bulk took a whole chunk of one (a 2,048-token
    chunk beside 80 ms decode steps ran 48 s, every stream and abort waiting). Found by the
    request fuzz on a real model."""
    cost = _memory_bound_cost()
    for n, c in [(64, 2000), (256, 4000), (32, 6000), (128, 1000)] * 4:
        cost.observe(PrefillSample(1, n, c, 0.1 + 0.003 * n + 1e-6 * n * (c + n / 2)))
    scheduler = _budgeted(cost)
    scheduler.enqueue([_prompt(t, 8000) for t in range(10, 13)])
    under_way = (PrefillRow(6000, 2000, progressed=True),)
    view = BatchView(rows=3, first_tokens_due=False, prefilling=under_way, decode_step_s=0.23)
    choice = scheduler.schedule(view)
    assert choice.bulk
    bound = BULK_DECODE_STEPS * 0.23
    assert choice.budget_s == pytest.approx(bound)
    assert choice.chunk >= 32 and cost.seconds(1, choice.chunk, 2000) <= bound
    fresh = _budgeted(cost)
    fresh.enqueue([_prompt(t, 8000) for t in range(1, 4)])
    choice = fresh.schedule(BatchView(rows=1, first_tokens_due=False, decode_step_s=0.23))
    assert choice.bulk and choice.admits
    rows = len(choice.admits)
    assert cost.seconds(rows, choice.chunk, 0) <= bound + 3 * 0.23  # with the finish allowance


def test_with_no_row_decoding_a_long_prompt_goes_in_bounded_steps():
    """Prompts only: a whole 2,048-token chunk of a long prompt held every request arriving
    or aborted meanwhile (20-40 s on a 2-core CPU). Once a decode step was timed, such a step
    is bounded like a bulk one, never below a second; before that, a full chunk."""
    cost = _memory_bound_cost()
    for n, c in [(64, 2000), (256, 4000), (32, 6000), (128, 1000)] * 4:
        cost.observe(PrefillSample(1, n, c, 0.1 + 0.003 * n + 1e-6 * n * (c + n / 2)))
    alone = (PrefillRow(6000, 2000, progressed=True),)
    for step_s in (0.08, 0.23):
        choice = _budgeted(cost).schedule(BatchView(1, False, alone, decode_step_s=step_s))
        bound = max(IDLE_STEP_FLOOR_S, BULK_DECODE_STEPS * step_s)
        assert choice.budget_s == pytest.approx(bound) and not choice.bulk
        assert choice.chunk >= 32 and cost.seconds(1, choice.chunk, 2000) <= bound
    assert _budgeted(cost).schedule(BatchView(1, False, alone)).chunk == 2048  # not yet timed
    fast = _budgeted(_linear_cost(5e-5)).schedule(BatchView(1, False, alone, decode_step_s=0.002))
    assert fast.chunk == 2048  # a fast machine's chunk stays whole


def test_a_lone_arrival_or_a_fast_model_keeps_the_budget():
    lone = _budgeted(_memory_bound_cost())
    lone.enqueue([_prompt(1, 4000)])
    choice = lone.schedule(BatchView(rows=1, first_tokens_due=False, decode_step_s=0.23))
    assert choice.chunk < 300 and not choice.bulk
    fast = _budgeted(_linear_cost(5e-4))
    fast.enqueue([_prompt(t, 400) for t in range(1, 25)])
    choice = fast.schedule(BatchView(rows=8, first_tokens_due=False, decode_step_s=0.003))
    assert choice.chunk < 399 and not choice.bulk  # split, the budget widened by the queue


def _with_image(ticket: int, image_tokens: int, text: int = 8) -> GenerationRequest:
    from servicer.messages import ImageInput, Tensor

    image = ImageInput(4, image_tokens, bytes([ticket]) * 16, Tensor(b"", (0,), "float32"))
    prompt = [1] * (image_tokens + text)
    return GenerationRequest(ticket, f"i{ticket}", prompt, 16, images=(image,))


def test_an_image_request_waits_for_its_encode_and_the_encoder_gets_what_prefill_leaves():
    """An image request whose images are not encoded yet is passed over (a text request behind
    it joins); it joins once they are. While rows run, the encoder's share of the step is the
    budget less the planned prefill; with nothing running it is unbounded. The budget is spent
    once: an embed beside it takes its part first, and a draft model's catch-up gets nothing
    while images wait."""
    from servicer.engine.prefill import StepCost

    encoded: set[int] = set()
    cost = StepCost()
    cost.prefill = _linear_cost(1e-4)
    scheduler = Scheduler(
        BIG, POLICY, ready=lambda r: not r.images or r.ticket in encoded, cost=cost
    )
    scheduler.enqueue([_with_image(1, 300), _prompt(3, 50)])
    decoding = BatchView(rows=2, first_tokens_due=False, decode_step_s=0.01)
    first = scheduler.schedule(decoding)
    assert [a.request.ticket for a in first.admits] == [3]
    left = max(first.budget_s - first.prefill_s, 0.0)
    embed, encode_s, catch_up = scheduler.share(first, True, embeds=False, images=True)
    assert (embed, encode_s, catch_up) == (None, pytest.approx(left), 0)
    embed, encode_s, _ = scheduler.share(first, True, embeds=True, images=True)
    assert encode_s == pytest.approx(max(left - cost.seconds(1, embed, 0), 0.0))
    assert encode_s < left
    assert scheduler.share(first, False, embeds=True, images=True) == (None, None, None)
    encoded.add(1)
    assert [a.request.ticket for a in scheduler.schedule(decoding).admits] == [1]
