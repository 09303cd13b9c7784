"""What a process holds from startup on stays out of the garbage collector's scans."""

from __future__ import annotations

import gc
import weakref

from conftest import demo_config
from support import ServerThread

from servicer.engine import Engine, EngineConfig
from servicer.model_files import ModelSpec, prepare_model_files
from servicer.outbox import Outbox


def test_a_ready_engine_leaves_its_model_out_of_the_collectors_generations(demo_dir) -> None:
    """A full collection while serving scans what serving made, not the model's modules and
    arrays (on the demo engine one stopped the engine thread ~55 ms, a gap in every
    stream)."""
    outbox = Outbox(lambda: None)
    engine = Engine(EngineConfig(prompt_cache_size=0), outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    try:
        engine.wait_ready(120)
        assert engine._loop is not None
        model = engine._loop.parts.loaded.model
        scanned = {id(o) for o in gc.get_objects()}
        assert id(model) not in scanned
        assert not any(id(layer) in scanned for layer in model.layers)
    finally:
        engine.shutdown(30)


def test_a_ready_worker_leaves_its_handlers_out_of_the_collectors_generations(demo_dir) -> None:
    """The handlers' process does the same once it reports SERVING (the engine in its own
    process froze its own)."""
    server = ServerThread(demo_config(demo_dir)).start()
    try:
        scanned = {id(o) for o in gc.get_objects()}
        assert server.server is not None
        assert id(server.server.servicer) not in scanned
    finally:
        server.stop()


def test_a_stopped_engine_can_be_collected(demo_dir) -> None:
    """Its loop holds itself in a cycle (its scheduler calls back into it): frozen, a stopped
    engine's model would stay in a process that goes on."""
    outbox = Outbox(lambda: None)
    engine = Engine(EngineConfig(prompt_cache_size=0), outbox)
    engine.start(prepare_model_files(ModelSpec(str(demo_dir))).info)
    engine.wait_ready(120)
    assert engine._loop is not None
    loop = weakref.ref(engine._loop)
    engine.shutdown(30)
    engine._loop = None
    del engine
    gc.collect()
    assert loop() is None
