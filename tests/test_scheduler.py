"""The scheduler's admission policy, on plain data (no MLX, no server)."""

from __future__ import annotations

from servicer.engine.scheduler import BatchView, Scheduler
from servicer.messages import Admission, GenerationRequest, MemoryModel

# 1 KiB per token, allocated one token at a time: a request costs (prompt + max_tokens) KiB.
ADMISSION = Admission(MemoryModel(((1024, None),), 0, allocation_step=1), limit_bytes=100 * 1024)
IDLE = BatchView(rows=0, first_tokens_due=False)


def _request(ticket: int, tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(ticket, f"r{ticket}", [1] * (tokens // 2), tokens - tokens // 2)


def test_admits_in_arrival_order_while_memory_lasts():
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1, 40), _request(2, 40), _request(3, 40)])
    admits = scheduler.admit(IDLE)
    assert [a.request.ticket for a in admits] == [1, 2]
    assert scheduler.reserved == 80 * 1024 and scheduler.waiting == 1
    assert scheduler.admit(BatchView(rows=2, first_tokens_due=False)) == []  # 3 waits
    scheduler.release(admits[0].reserved)
    assert [a.request.ticket for a in scheduler.admit(BatchView(2, False))] == [3]


def test_a_request_alone_is_admitted_even_past_the_limit():
    # The handler refuses what could never fit; past the limit alone means nothing runs.
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1, 150)])
    assert [a.request.ticket for a in scheduler.admit(IDLE)] == [1]


def test_nothing_is_admitted_while_a_first_token_is_due():
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1)])
    assert scheduler.admit(BatchView(rows=1, first_tokens_due=True)) == []
    assert len(scheduler.admit(BatchView(rows=1, first_tokens_due=False))) == 1


def test_withdraw_drain_and_forgetting_reservations():
    scheduler = Scheduler(ADMISSION)
    scheduler.enqueue([_request(1), _request(2), _request(3)])
    assert scheduler.withdraw({2, 9}) == [2]
    admitted = scheduler.admit(BatchView(rows=0, first_tokens_due=False))
    assert [a.request.ticket for a in admitted] == [1, 3]
    scheduler.enqueue([_request(4)])
    assert scheduler.drain() == [4] and scheduler.waiting == 0
    scheduler.forget_reservations()
    assert scheduler.reserved == 0
