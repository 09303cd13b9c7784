"""Engine events -> the messages one client gets: chunks and the final GenerateComplete, text
and stop strings included (the engine ends a row at the token that completes a stop string;
this cuts the text). Pure: it touches no engine, metrics or I/O, and says what the handler
must send."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .faces import MLX_FACE, Face
from .messages import FINISH_ABORT, FINISH_STOP, GenerationRequest, RowEvent
from .text import TextTracker


@dataclass(slots=True)
class Emission:
    """What one batch of events means for the client."""

    responses: list[Any] = field(default_factory=list)  # the face's GenerateResponses
    tokens: int = 0  # new tokens the client gets
    finish_reason: str | None = None  # set with the last batch


class OutputProcessor:
    """One Generate call's output: a chunk per batch and a GenerateComplete for a stream; only
    the GenerateComplete, with every token, for a unary call."""

    __slots__ = (
        "_collected",
        "_completion_tokens",
        "_face",
        "_index",
        "_request",
        "_stream",
        "_text",
    )

    def __init__(
        self,
        request: GenerationRequest,
        stream: bool,
        text: TextTracker | None = None,
        face: Face = MLX_FACE,
        index: int = 0,
    ) -> None:
        self._request = request
        self._stream = stream
        self._text = text  # decoded text and stop strings, when the request wants them
        self._face = face
        self._index = index  # which of the request's n samples this is
        self._completion_tokens = 0
        self._collected: list[RowEvent] = []  # a unary call's tokens so far

    def process(self, events: list[RowEvent]) -> Emission:
        last = events[-1]
        tokens = [e for e in events if e.token is not None]
        emission = Emission(finish_reason=last.finish_reason)
        matched_token, matched_text, text = last.matched_stop_token_id, None, ""
        tracker = self._text
        if tracker is not None:
            taken = tracker.add([e.token for e in tokens])  # type: ignore[misc]
            if tracker.matched is not None and last.finish_reason != FINISH_ABORT:
                del tokens[taken:]
                emission.finish_reason, matched_token = FINISH_STOP, None
                matched_text = tracker.matched
            text = tracker.release(final=emission.finish_reason is not None)
        emission.tokens = len(tokens)
        self._completion_tokens += len(tokens)
        if self._stream:
            if tokens or text:
                emission.responses.append(self._chunk(tokens, text, last.cached_tokens))
        else:
            self._collected.extend(tokens)
        if emission.finish_reason is not None:
            complete = self._complete(emission.finish_reason, last.cached_tokens)
            if matched_token is not None:
                setattr(complete.complete, self._face.matched_token_field, matched_token)
            if matched_text is not None:
                setattr(complete.complete, self._face.matched_text_field, matched_text)
            emission.responses.append(complete)
        return emission

    def _chunk(self, tokens: list[RowEvent], text: str, cached: int) -> Any:
        response = self._face.pb.GenerateResponse()
        chunk = response.chunk  # filled in place: building it apart and copying costs twice
        chunk.token_ids.extend([e.token for e in tokens])  # type: ignore[misc]
        chunk.prompt_tokens = len(self._request.prompt)
        chunk.completion_tokens = self._completion_tokens
        chunk.cached_tokens = cached
        if self._index:
            chunk.index = self._index
        if text and self._face.carries_text:
            chunk.text = text
        if self._request.top_logprobs is not None:
            fill_logprobs(chunk.output_logprobs, tokens)
        return response

    def _complete(self, finish_reason: str, cached: int) -> Any:
        response = self._face.pb.GenerateResponse()
        complete = response.complete
        complete.finish_reason = finish_reason
        complete.prompt_tokens = len(self._request.prompt)
        complete.completion_tokens = self._completion_tokens
        complete.cached_tokens = cached
        if self._index:
            complete.index = self._index
        if not self._stream:
            complete.output_ids.extend([e.token for e in self._collected])  # type: ignore[misc]
            if self._text is not None and self._face.carries_text:
                complete.output_text = self._text.text
            if self._request.top_logprobs is not None:
                fill_logprobs(complete.output_logprobs, self._collected)
        return response


def fill_logprobs(out: Any, events: list[RowEvent]) -> None:
    """Fill an OutputLogProbs (either face's) with these events' logprobs."""
    for event in events:
        if event.logprob is None or event.token is None:
            continue
        out.token_ids.append(event.token)
        out.token_logprobs.append(event.logprob.logprob)
        out.top_logprobs.add(values=event.logprob.top_logprobs, token_ids=event.logprob.top_ids)
