"""The VllmEngine face, driven with its own messages: every SamplingParams field is honoured or
refused by name, n rows come from one prefill, and load, KV events and flushes answer at once."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import demo_config
from support import ServerThread, wait_until

from servicer.proto import common_pb2
from servicer.proto import vllm_engine_pb2 as vpb
from servicer.proto import vllm_engine_pb2_grpc as vgrpc


@pytest.fixture(scope="module")
def face(demo_dir) -> Iterator[tuple[ServerThread, vgrpc.VllmEngineStub]]:
    config = dataclasses.replace(demo_config(demo_dir), protocols=("vllm",))
    with ServerThread(config) as running, running.channel() as channel:
        yield running, vgrpc.VllmEngineStub(channel)


_ids = iter(range(1_000_000))


def request(prompt: list[int], stream: bool = True, **params) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=f"v-{next(_ids)}",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**params),
        stream=stream,
    )


def collect(stub, message) -> tuple[dict[int, list[int]], dict[int, vpb.GenerateComplete]]:
    tokens: dict[int, list[int]] = {}
    completes: dict[int, vpb.GenerateComplete] = {}
    for response in stub.Generate(message, timeout=120):
        if response.HasField("chunk"):
            tokens.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
        else:
            assert response.complete.index not in completes
            completes[response.complete.index] = response.complete
    return tokens, completes


def refused(stub, message) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        collect(stub, message)
    return caught.value


def test_the_face_is_the_same_engine_as_mlx(face, reference, prompts):
    _, stub = face
    tokens, completes = collect(stub, request(prompts[0], temperature=0, max_tokens=12))
    assert tokens[0] == reference.greedy(prompts[0], 12)[: len(tokens[0])]
    assert completes[0].completion_tokens == len(tokens[0])
    info = stub.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.is_generation and info.vocab_size == reference.model.args.vocab_size
    assert stub.HealthCheck(vpb.HealthCheckRequest()).healthy
    server = stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert server.block_size > 0 and server.max_num_seqs > 0


def test_n_rows_share_one_prefill_and_their_seeds(face, prompts):
    _, stub = face
    prompt = (prompts[1] * 200)[:600]
    params = {"temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 10, "ignore_eos": True}
    tokens, completes = collect(stub, request(prompt, **params))
    assert sorted(completes) == [0, 1, 2] and sorted(tokens) == [0, 1, 2]
    assert len({tuple(t) for t in tokens.values()}) == 3
    # The rows after the first reuse the first one's prompt blocks.
    assert all(completes[i].cached_tokens >= 512 for i in (1, 2))
    again, _ = collect(stub, request(prompt, **params))
    assert again == tokens
    unary = request(prompt, stream=False, **params)
    _, whole = collect(stub, unary)
    assert {i: list(c.output_ids) for i, c in whole.items()} == tokens


def test_abort_ends_all_n_rows(face, prompts):
    running, stub = face
    message = request(prompts[2], temperature=1.0, n=3, max_tokens=3000, ignore_eos=True)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(collect(stub, message)))
    thread.start()
    assert wait_until(lambda: running.server.load().running >= 3, timeout=30)
    stub.Abort(vpb.AbortRequest(request_ids=[message.request_id]))
    thread.join(30)
    _, completes = result[0]
    assert {c.finish_reason for c in completes.values()} == {"abort"}
    assert wait_until(lambda: running.server.servicer.active_requests == 0, timeout=10)


def test_an_abort_before_the_first_token_ends_all_n_rows(face):
    """Abort while the first row still prefills: the other rows, not in the engine yet, end
    with it (they used to start afterwards and run to max_tokens). Found by request_fuzz.py."""
    running, stub = face
    prompt = [5 + (i * 7) % 500 for i in range(4000)]  # a prefill of seconds on a CPU
    message = request(prompt, temperature=1.0, n=3, max_tokens=2000, ignore_eos=True)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(collect(stub, message)))
    thread.start()
    assert wait_until(lambda: running.server.servicer.active_requests == 3, timeout=30)
    stub.Abort(vpb.AbortRequest(request_ids=[message.request_id]))
    thread.join(60)
    _, completes = result[0]
    assert sorted(completes) == [0, 1, 2]
    assert {c.finish_reason for c in completes.values()} == {"abort"}
    assert wait_until(lambda: running.server.servicer.active_requests == 0, timeout=10)


def test_stop_token_ids_min_tokens_and_ignore_eos(face, reference, prompts):
    _, stub = face
    greedy = reference.greedy(prompts[3], 12)
    stop_at = greedy[3]
    tokens, completes = collect(
        stub, request(prompts[3], temperature=0, max_tokens=12, stop_token_ids=[stop_at])
    )
    assert tokens[0] == greedy[: greedy.index(stop_at) + 1]
    assert completes[0].matched_token_id == stop_at
    # min_tokens masks the stop token until that many tokens are out.
    late = greedy.index(stop_at) + 2
    params = {"temperature": 0, "max_tokens": 12, "stop_token_ids": [stop_at], "min_tokens": late}
    tokens, _ = collect(stub, request(prompts[3], **params))
    assert stop_at not in tokens[0][:late] and len(tokens[0]) >= late


def test_truncate_prompt_tokens_keeps_the_prompts_end(face, reference, prompts):
    _, stub = face
    prompt = prompts[4] + prompts[5]
    keep = len(prompts[5])
    _, completes = collect(
        stub, request(prompt, temperature=0, max_tokens=6, truncate_prompt_tokens=keep)
    )
    assert completes[0].prompt_tokens == keep


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"n": 17}, "n must be"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
        ({"choice": vpb.ChoiceConstraint()}, "choice"),
    ],
)
def test_what_the_worker_cannot_honour_is_refused_by_name(face, prompts, params, named):
    _, stub = face
    error = refused(stub, request(prompts[0], **params))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in error.details()


def test_media_beside_the_prompt_is_refused_and_empty_media_fields_are_served(
    face, reference, prompts
):
    """A text model given an image's placeholder tokens without the image answers wrongly:
    media is refused by name. Empty media messages, a transfer address and a rank (the
    router may fill them on text requests) change nothing."""
    _, stub = face
    image = vpb.MultimodalInputs(im_token_id=5, mm_placeholders=[vpb.PlaceholderRange(length=2)])
    media = [
        {"mm_inputs": image},
        {"extra_mm_inputs": [image]},
        {"media_refs": vpb.MediaRefs(items=[vpb.MediaRef(url="https://example.com/a.png")])},
    ]
    for fields in media:
        message = request(prompts[0], temperature=0, max_tokens=4)
        message.MergeFrom(vpb.GenerateRequest(**fields))
        error = refused(stub, message)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "multimodal inputs are not supported" in error.details()
    message = request(prompts[0], temperature=0, max_tokens=6, ignore_eos=True)
    message.mm_inputs.SetInParent()
    message.media_refs.SetInParent()
    message.kv_transfer_params.remote_host = "10.0.0.1"
    message.data_parallel_rank = 0
    tokens, _ = collect(stub, message)
    assert tokens[0] == reference.greedy(prompts[0], 6)


def test_constraints_of_the_vllm_kinds(face, prompts, reference):
    _, stub = face
    decode = reference.tokenizer.decode
    yes_no = {"grammar": 'root ::= "yes" | "no"'}
    choice = {"choice": vpb.ChoiceConstraint(choices=["red", "green"])}
    for constraint, allowed in ((yes_no, {"yes", "no"}), (choice, {"red", "green"})):
        tokens, _ = collect(stub, request(prompts[0], temperature=0, max_tokens=8, **constraint))
        assert decode(tokens[0], skip_special_tokens=True) in allowed
    tokens, _ = collect(stub, request(prompts[0], temperature=0, max_tokens=8, json_object=True))
    assert decode(tokens[0], skip_special_tokens=True).startswith("{")


def test_a_complete_grammar_ends_the_row_whatever_min_tokens_asks(face, reference):
    """Once the grammar is complete only EOS may follow, and min_tokens masked EOS: no token
    was left, and the row drew forbidden tokens with NaN logprobs. The grammar wins: the
    constrained text, then EOS. Found by request_fuzz.py."""
    _, stub = face
    choice = vpb.ChoiceConstraint(choices=["yes"])
    for temperature in (0.0, 1.0):
        message = request(
            [0, 5, 6, 7, 8], temperature=temperature, max_tokens=8, min_tokens=5, logprobs=1,
            choice=choice, seed=3,
        )  # fmt: skip
        tokens, completes = collect(stub, message)
        text = reference.tokenizer.decode(tokens[0], skip_special_tokens=True)
        assert text == "yes" and completes[0].finish_reason == "stop", (tokens, text)


def test_json_object_false_asks_for_no_constraint(face, reference, prompts):
    _, stub = face
    tokens, _ = collect(
        stub, request(prompts[1], temperature=0, max_tokens=8, ignore_eos=True, json_object=False)
    )
    assert tokens[0] == reference.greedy(prompts[1], 8)


def test_profiling_is_unimplemented_in_words_without_an_error_logged(face, caplog):
    """The generated default answered "Method not implemented!" and logged a traceback at
    ERROR for every call. Found by request_fuzz.py."""
    _, stub = face
    calls = (
        (stub.StartProfile, common_pb2.StartProfileRequest()),
        (stub.StopProfile, common_pb2.StopProfileRequest()),
    )
    for call, message in calls:
        with pytest.raises(grpc.RpcError) as caught:
            call(message, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "profiling is not offered" in caught.value.details()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_get_loads_answers_at_once_with_the_requests_in_flight(face, prompts):
    running, stub = face
    message = request(prompts[1], temperature=1.0, n=2, max_tokens=3000, ignore_eos=True)
    thread = threading.Thread(target=lambda: collect(stub, message))
    thread.start()
    try:
        assert wait_until(lambda: running.server.load().running >= 2, timeout=30)
        # The router polls with a deadline; a late answer is DEADLINE_EXCEEDED here.
        loads = stub.GetLoads(vpb.GetLoadsRequest(include=["core"]), timeout=2)
        load = loads.loads[0]
        assert load.num_running_reqs >= 2 and load.num_total_reqs >= 2
        assert 0 < load.num_used_tokens <= load.max_total_num_tokens
        assert 0 < load.token_usage < 1 and load.max_running_requests > 0
        assert wait_until(
            lambda: stub.GetLoads(vpb.GetLoadsRequest()).loads[0].gen_throughput > 0, 10
        )
    finally:
        stub.Abort(vpb.AbortRequest(request_ids=[message.request_id]))
        thread.join(30)


def test_kv_events_snapshot_resume_and_flush(face, prompts):
    _, stub = face
    prompt = (prompts[6] * 200)[:520]  # two full blocks
    collect(stub, request(prompt, temperature=0, max_tokens=2))
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    # The router drops a worker whose stream has not answered within 2 s: the headers must
    # come at once, before any event (a wait past the deadline raises TimeoutError here).
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(events.initial_metadata).result(timeout=2) is not None
    snapshot = next(events)
    assert snapshot.events[0].HasField("cleared")
    stored = [e.stored for e in snapshot.events if e.HasField("stored")]
    chains = {tuple(s.blocks[0].token_ids) for s in stored}
    assert tuple(prompt[:256]) in chains and tuple(prompt[256:512]) in chains
    after = snapshot.sequence_number
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30)
    assert flushed.success
    cleared = next(events)
    assert cleared.sequence_number == after + 1
    assert [e.WhichOneof("data") for e in cleared.events] == ["cleared"]
    events.cancel()
    # A router that reconnects resumes after the last batch it saw, with no snapshot.
    resumed = stub.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=after), timeout=60
    )
    assert next(resumed).sequence_number == after + 1
    resumed.cancel()
    _, completes = collect(stub, request(prompt, temperature=0, max_tokens=2))
    assert completes[0].cached_tokens == 0  # the flush emptied the store


def test_embed_and_an_embedding_refusal(face, reference):
    _, stub = face
    ids = reference.tokenizer.encode("The river runs.")
    answer = stub.Embed(
        vpb.EmbedRequest(request_id="e1", tokenized=vpb.TokenizedInput(input_ids=ids))
    )
    assert answer.embedding_dim == reference.model.args.hidden_size == len(answer.embedding)
    assert stub.GetModelInfo(vpb.GetModelInfoRequest()).embedding_size == answer.embedding_dim
    assert answer.prompt_tokens == len(ids)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(vpb.EmbedRequest(request_id="e2", tokenized=vpb.TokenizedInput()))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_both_faces_give_the_same_tokens_with_speculation_and_quantized_kv(demo_dir, prompts):
    """One engine behind both services: what speculation, quantized KV and the prefix store do
    on the MLX face they do on the vLLM face, token for token."""
    from support import generate

    config = demo_config(demo_dir, speculate="ngram", kv_bits=8)
    config = dataclasses.replace(config, protocols=("mlx", "vllm"))
    with ServerThread(config) as running, running.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        for prompt in prompts[:4]:
            echo = (prompt * 30)[:300]  # copy-heavy: prompt lookup drafts
            params = {"temperature": 0, "max_tokens": 24}
            tokens, _ = collect(stub, request(echo, **params))
            assert tokens[0] == generate(channel, echo, **params).tokens
            seeded = {"temperature": 0.9, "seed": 3, "max_tokens": 16, "ignore_eos": True}
            tokens, _ = collect(stub, request(echo, **seeded))
            assert tokens[0] == generate(channel, echo, **seeded).tokens


def test_a_worker_without_a_prefix_cache_has_no_kv_events(demo_dir):
    config = dataclasses.replace(
        demo_config(demo_dir, prompt_cache_size=0), protocols=("vllm",), engine_mode="thread"
    )
    with ServerThread(config) as running, running.channel() as channel:
        stub = vgrpc.VllmEngineStub(channel)
        events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            next(events)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert stub.FlushCache(common_pb2.FlushCacheRequest()).success
