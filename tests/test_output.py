"""OutputProcessor: engine events -> the messages a client gets (pure, no server)."""

from __future__ import annotations

import sys

from test_text_tracker import decode

from servicer.messages import GenerationRequest, RowEvent, TokenLogprob
from servicer.output import OutputProcessor
from servicer.text import TextTracker, WindowDecoder

PROMPT = [1, 2, 3, 4]


def _request(**fields) -> GenerationRequest:
    return GenerationRequest(1, "r", PROMPT, 10, **fields)


def test_a_stream_gets_a_chunk_per_batch_then_the_complete():
    output = OutputProcessor(_request(), stream=True)
    first = output.process([RowEvent(1, 7, cached_tokens=2)])
    assert [r.chunk.token_ids for r in first.responses] == [[7]]
    assert first.tokens == 1 and first.finish_reason is None
    last = output.process([RowEvent(1, 8), RowEvent(1, 9, "stop", matched_stop_token_id=9)])
    chunk, complete = (r for r in last.responses)
    assert list(chunk.chunk.token_ids) == [8, 9] and chunk.chunk.completion_tokens == 3
    assert chunk.chunk.prompt_tokens == len(PROMPT)
    assert complete.complete.finish_reason == "stop"
    assert complete.complete.matched_stop_token_id == 9
    assert complete.complete.completion_tokens == 3 and not complete.complete.output_ids
    assert last.finish_reason == "stop"


def test_a_unary_call_gets_one_complete_with_every_token_and_logprob():
    output = OutputProcessor(_request(top_logprobs=1, tokens_per_handoff=sys.maxsize), False)
    lp = TokenLogprob(-0.5, (7,), (-0.5,))
    assert output.process([RowEvent(1, 7, logprob=lp)]).responses == []
    done = output.process([RowEvent(1, 8, logprob=lp), RowEvent(1, 9, "length", logprob=lp)])
    (response,) = done.responses
    assert list(response.complete.output_ids) == [7, 8, 9]
    assert list(response.complete.output_logprobs.token_ids) == [7, 8, 9]
    assert response.complete.completion_tokens == 3


def test_an_abort_with_no_token_ends_the_stream_with_no_chunk():
    output = OutputProcessor(_request(), stream=True)
    output.process([RowEvent(1, 7)])
    done = output.process([RowEvent(1, None, "abort")])
    assert [r.WhichOneof("response") for r in done.responses] == ["complete"]
    assert done.responses[0].complete.completion_tokens == 1


def test_a_stop_string_cuts_the_output():
    # Tokens 0, 1, 2 decode to "Hel", "lo", " w": the stop string "lo" completes at token 1.
    output = OutputProcessor(_request(), True, TextTracker(WindowDecoder(decode), ["lo"]))
    done = output.process([RowEvent(1, 0), RowEvent(1, 1), RowEvent(1, 2)])
    assert done.finish_reason == "stop" and done.tokens == 2
    chunk, complete = done.responses
    assert list(chunk.chunk.token_ids) == [0, 1] and chunk.chunk.text == "Hel"
    assert complete.complete.matched_stop == "lo"
    assert not complete.complete.HasField("matched_stop_token_id")
