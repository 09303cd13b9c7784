"""A step's tokens are handed over before its rows' blocks are kept (a finished row's client is
waiting for its last token to send the next request), and a keep's copies never wait for the
forward in flight (a whole step on a GPU)."""

from __future__ import annotations

import threading

from servicer.engine import Engine, EngineConfig
from servicer.engine.prefix.store import PrefixStore
from servicer.messages import GenerationRequest, SamplingSpec, StepOutput
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox


class Timeline:
    """The engine's hand-offs and the store's keeps, in the order they happened."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, object]] = []
        self.cond = threading.Condition()
        self.outbox = Outbox(self._woken)

    def _woken(self) -> None:
        out = self.outbox.take()
        assert out is not None
        self.add("handed", out)

    def add(self, what: str, detail: object) -> None:
        with self.cond:
            self.entries.append((what, detail))
            self.cond.notify_all()

    def wait(self, predicate, timeout: float = 60) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.entries), timeout), [
                (what, detail if what == "keep" else [e.finish_reason for e in detail.events])
                for what, detail in self.entries
            ]


def _finished(entries) -> bool:
    return any(
        what == "handed" and any(e.finish_reason for e in out.events) for what, out in entries
    )


def test_a_finished_rows_last_token_goes_out_before_its_blocks_are_kept(
    demo_dir, prompts, monkeypatch
):
    timeline = Timeline()
    keep = PrefixStore._keep

    def recorded(store, tokens, cache, snapshot):
        timeline.add("keep", len(tokens))
        keep(store, tokens, cache, snapshot)

    monkeypatch.setattr(PrefixStore, "_keep", recorded)
    engine = Engine(EngineConfig(prompt_cache_block=16), timeline.outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    engine.wait_ready(120)
    try:
        prompt = [token for prompt in prompts for token in prompt]  # past a 16-token block
        request = GenerationRequest(
            ticket=1,
            request_id="keep-after",
            prompt=prompt,
            max_tokens=6,
            sampling=SamplingSpec(temperature=0.0),
        )
        engine.submit(request)

        def kept_after_finish(entries) -> list[int]:
            finish = next((i for i, entry in enumerate(entries) if _finished([entry])), None)
            after = entries[finish + 1 :] if finish is not None else []
            return [length for what, length in after if what == "keep"]

        timeline.wait(lambda entries: kept_after_finish(entries), timeout=20)
        assert max(kept_after_finish(timeline.entries)) > len(prompt)  # prompt and output

        # Nothing runs after it: the kept blocks' events go out at once, not with the output
        # of a next request that may never come.
        def stored_events(entries) -> int:
            return sum(
                1
                for what, out in entries
                if what == "handed" and isinstance(out, StepOutput)
                for event in out.kv_events
                if event.kind == "stored"
            )

        timeline.wait(lambda entries: stored_events(entries) >= len(prompt) // 16)
    finally:
        engine.shutdown(30)


def test_kept_later_blocks_enter_at_keep_pending_and_a_flush_drops_them():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from servicer.engine.prefix.keys import block_keys
    from servicer.engine.prefix.store import CacheLayout

    def cache_of(length: int) -> KVCache:
        cache = KVCache()
        cache.update_and_fetch(
            mx.random.normal((1, 2, length, 8)), mx.random.normal((1, 2, length, 8))
        )
        return cache

    store = PrefixStore(CacheLayout.of([KVCache()]), 16, 64, 1 << 20)
    tokens = list(range(40))
    store.keep_later(tokens, [cache_of(40)], snapshot=True)
    assert len(store.index) == 0  # nothing yet: the step's output goes first
    assert store.keep_pending()  # two full blocks and a tail: events wait
    prompt = [*tokens, 7]
    assert len(store.index) == 3
    assert store.index.match(prompt, block_keys(prompt, 16)).length == 40
    store.take_events()
    store.keep_later(list(range(100, 140)), [cache_of(40)], snapshot=True)
    store.flush()  # what was computed before a flush is not kept after it
    store.take_events()
    assert not store.keep_pending()
    assert len(store.index) == 0


def test_keeping_blocks_does_not_wait_for_the_computation_that_made_them(monkeypatch):
    """The copies of a keep go to MLX's queue behind the step in flight instead of waiting for
    it: the engine thread builds the next step meanwhile. The blocks hold the right values."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from servicer.engine.prefix import store as store_module
    from servicer.engine.prefix.store import CacheLayout

    waits: list[int] = []

    class NoWaits:
        def __getattr__(self, name: str):
            if name == "eval":
                return lambda *arrays: waits.append(len(arrays))
            return getattr(mx, name)

    monkeypatch.setattr(store_module, "mx", NoWaits())
    source = mx.random.normal((1, 2, 40, 8), key=mx.random.key(3))
    keys, values = source * 2, source - 1  # still to be computed
    cache = KVCache()
    cache.update_and_fetch(keys, values)
    store = PrefixStore(CacheLayout.of([KVCache()]), 16, 64, 1 << 20)
    store.keep_later(list(range(40)), [cache], snapshot=True)
    assert store.keep_pending()
    assert waits == []
    nodes = store.index.ram_nodes()
    assert [node.start for node in nodes] == [0, 16, 32]
    for node in nodes:
        ((kept_keys, kept_values),) = node.ram.kv
        start, end = node.start, node.start + len(node.tokens)
        assert mx.array_equal(kept_keys, (source * 2)[..., start:end, :]).item()
        assert mx.array_equal(kept_values, (source - 1)[..., start:end, :]).item()
