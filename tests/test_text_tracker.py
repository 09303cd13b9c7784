"""TextTracker: incremental decoding and stop strings, on a byte-level toy tokenizer."""

from __future__ import annotations

from servicer.text import TextTracker, WindowDecoder

# Token i decodes to the bytes VOCAB[i]; a character's bytes may be split over tokens.
VOCAB = [b"Hel", b"lo", b" w", b"or", b"ld", b".", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"!"]


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def _tokens(text: bytes) -> list[int]:
    """Greedy longest-match tokenization over VOCAB."""
    out, i = [], 0
    while i < len(text):
        best = max(
            (t for t in range(len(VOCAB)) if text.startswith(VOCAB[t], i)),
            key=lambda t: len(VOCAB[t]),
        )
        out.append(best)
        i += len(VOCAB[best])
    return out


def test_text_arrives_whole_whatever_the_token_boundaries():
    tracker = TextTracker(WindowDecoder(decode))
    pieces = []
    for token in _tokens(b"Hello world."):
        tracker.add([token])
        pieces.append(tracker.release())
    pieces.append(tracker.release(final=True))
    assert "".join(pieces) == "Hello world."


def test_multi_byte_characters_split_across_tokens_are_never_half_sent():
    tracker = TextTracker(WindowDecoder(decode))
    seen = []
    for token in _tokens("é€!".encode()):  # é = c3 a9 over two tokens, € = e2 82 ac over two
        tracker.add([token])
        released = tracker.release()
        seen.append(released)
        assert "\ufffd" not in released
    seen.append(tracker.release(final=True))
    assert "".join(seen) == "é€!"
    assert seen[0] == ""  # the first byte of é alone is no character yet


def test_a_stop_string_split_across_tokens_is_found_and_cut():
    tracker = TextTracker(WindowDecoder(decode), stops=["lo w"])
    tokens = _tokens(b"Hello world.")  # "lo" and " w" are separate tokens
    taken = tracker.add(tokens)
    assert tracker.matched == "lo w"
    assert taken == 3  # the token that completed the stop string is the last one taken
    assert tracker.release(final=True) == "Hel"


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    tracker = TextTracker(WindowDecoder(decode), stops=["world!"])
    tracker.add(_tokens(b"Hello wor"))
    # The last len("world!") - 1 characters could still be the start of the stop string.
    assert tracker.release() == "Hell"
    tracker.add(_tokens(b"ld."))
    assert tracker.matched is None
    assert tracker.release(final=True) == "o world."


def test_the_earliest_of_several_stop_strings_wins():
    tracker = TextTracker(WindowDecoder(decode), stops=["world", "lo"])
    tracker.add(_tokens(b"Hello world."))
    assert tracker.matched == "lo"
    assert tracker.text == "Hel"


def test_the_rust_stream_decoder_gives_the_same_text_as_the_window_decoder():
    import random

    from transformers import AutoTokenizer

    from servicer.demos.text import demo_model_path
    from servicer.text import StreamDecoder

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path()))
    rng = random.Random(3)
    tokens = [rng.randrange(0, 512) for _ in range(400)]  # byte pieces, specials and all
    texts = []
    for decoder in (
        StreamDecoder(tokenizer.backend_tokenizer),
        WindowDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)),
    ):
        tracker = TextTracker(decoder)
        tracker.add(tokens)
        texts.append(tracker.text)
    assert texts[0] == texts[1] and len(texts[0]) > 100
