"""Abort and client cancel: streams end promptly, rows are freed, the next request is normal."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from conftest import demo_config
from support import ServerThread, generate, make_request, server_info, wait_until

from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc

LONG = 3000  # far more tokens than any test waits for


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, demo_dir) -> Iterator[ServerThread]:
    """Every abort test runs against both engine modes."""
    with ServerThread(replace(demo_config(demo_dir), engine_mode=request.param)) as running:
        yield running


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    with server.channel() as chan:
        yield chan


def _engine_idle(server) -> bool:
    load = server.server.load()
    return load.running == 0 and load.waiting == 0


def test_abort_mid_stream_ends_with_abort_within_a_few_steps(server, channel, prompts):
    stub = pb_grpc.MlxEngineStub(channel)
    seen_at_abort: list[int] = []

    def abort_after_five(chunk: pb.GenerateStreamChunk) -> None:
        if chunk.completion_tokens >= 5 and not seen_at_abort:
            seen_at_abort.append(chunk.completion_tokens)
            stub.Abort(pb.AbortRequest(request_ids=["to-abort"]), timeout=10)

    outcome = generate(
        channel,
        prompts[0],
        request_id="to-abort",
        temperature=0,
        max_tokens=LONG,
        ignore_eos=True,
        on_chunk=abort_after_five,
    )
    assert outcome.error is None
    assert outcome.complete.finish_reason == "abort"
    # Chunks already on the wire when Abort landed still arrive; the engine stops at its next
    # step, so only a handful more tokens follow: the steps it took while the chunk reached the
    # client and the Abort came back (1-2 here, 5-6 with two CPU hogs beside the test).
    assert outcome.complete.completion_tokens - seen_at_abort[0] <= 16
    assert outcome.complete.completion_tokens == len(outcome.tokens)
    assert wait_until(lambda: _engine_idle(server))
    assert server_info(channel).active_requests == 0


def test_abort_of_a_unary_call_returns_abort_with_what_was_generated(server, channel, prompts):
    stub = pb_grpc.MlxEngineStub(channel)
    result = {}

    def call() -> None:
        result["outcome"] = generate(
            channel,
            prompts[1],
            stream=False,
            request_id="unary-abort",
            max_tokens=LONG,
            temperature=0,
            ignore_eos=True,
        )

    worker = threading.Thread(target=call)
    worker.start()
    assert wait_until(lambda: server_info(channel).active_requests == 1)
    stub.Abort(pb.AbortRequest(request_ids=["unary-abort"]), timeout=10)
    worker.join(60)
    complete = result["outcome"].complete
    assert complete.finish_reason == "abort"
    assert complete.completion_tokens == len(complete.output_ids) < LONG
    assert wait_until(lambda: _engine_idle(server))


def test_abort_with_unknown_ids_touches_nothing_else(channel, reference, prompts):
    stub = pb_grpc.MlxEngineStub(channel)

    def abort_strangers(chunk: pb.GenerateStreamChunk) -> None:
        stub.Abort(pb.AbortRequest(request_ids=["nobody", "", "bystander-x"]), timeout=10)

    outcome = generate(
        channel,
        prompts[1],
        request_id="bystander",
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        on_chunk=abort_strangers,
    )
    assert outcome.error is None  # every Abort answered OK, and this request ran to the end
    assert outcome.complete.finish_reason == "length"
    assert outcome.tokens == reference.greedy(prompts[1], 12)


def test_client_cancel_frees_the_row_and_the_next_request_runs_normally(
    server, channel, reference, prompts
):
    stub = pb_grpc.MlxEngineStub(channel)
    call = stub.Generate(
        make_request(prompts[2], temperature=0, max_tokens=LONG, ignore_eos=True), timeout=60
    )
    for received, _ in enumerate(call, start=1):
        if received == 3:
            call.cancel()
            break
    assert wait_until(lambda: server_info(channel).active_requests == 0)
    assert wait_until(lambda: _engine_idle(server))
    follow_up = generate(channel, prompts[3], temperature=0, max_tokens=16, ignore_eos=True)
    assert follow_up.tokens == reference.greedy(prompts[3], 16)
    assert server_info(channel).active_requests == 0


def test_deadline_frees_the_row(server, channel, prompts):
    outcome = generate(
        channel, prompts[4], temperature=0, max_tokens=LONG, ignore_eos=True, timeout=1.0
    )
    assert outcome.code is not None and outcome.code.name == "DEADLINE_EXCEEDED"
    assert 0 < len(outcome.tokens) < LONG  # the deadline passed while its row was decoding
    assert wait_until(lambda: server_info(channel).active_requests == 0)
    assert wait_until(lambda: _engine_idle(server))
