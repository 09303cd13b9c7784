"""The model's metadata comes from its files, before the weights load, and is the same after."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest
from conftest import demo_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import BackgroundGenerate, ServerThread, generate

from servicer.demos.text import demo_model_path
from servicer.faults import FaultPlan
from servicer.model_files import ModelLoadError, ModelSpec, prepare_model_files
from servicer.proto import common_pb2
from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc


def _with_faults(model_dir, spec: str, **engine):
    config = demo_config(model_dir, **engine)
    return replace(config, engine=replace(config.engine, faults=FaultPlan.parse(spec)))


def _metadata(channel: grpc.Channel, timeout: float = 30) -> dict[str, object]:
    stub = pb_grpc.MlxEngineStub(channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout))
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
    return {
        "model_info": {f.name: value for f, value in info.ListFields()},
        "tokenizer": [(c.data, c.sha256) for c in chunks],
        "server_type": server.server_type,
    }


def _serving(channel: grpc.Channel) -> bool:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return status.status == health_pb2.HealthCheckResponse.SERVING


def test_metadata_while_loading_equals_metadata_once_loaded(demo_dir, prompts):
    config = _with_faults(demo_dir, "load:4")
    with ServerThread(config, wait_ready=False) as running, running.channel() as chan:
        loading = _metadata(chan)
        assert not _serving(chan)  # the answers above came while the weights were loading
        # It waits for the model within its deadline; one shorter than the load is refused.
        early = generate(chan, prompts[0], max_tokens=2, timeout=1.5)
        assert early.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "still loading" in early.error.details()
        with pytest.raises(grpc.RpcError) as abort:
            pb_grpc.MlxEngineStub(chan).Abort(pb.AbortRequest(request_ids=["x"]), timeout=10)
        assert abort.value.code() == grpc.StatusCode.UNAVAILABLE
        running.run(running.server.wait_ready(120))
        assert _serving(chan)
        loaded = _metadata(chan)
    for name in ("model_path", "served_model_name", "vocab_size", "max_context_length"):
        assert name in loading["model_info"], name
    assert loading["model_info"] == loaded["model_info"]
    assert loading["tokenizer"] == loaded["tokenizer"]
    assert loading == loaded


def test_a_request_while_loading_waits_for_the_model(demo_dir, prompts):
    config = _with_faults(demo_dir, "load:3")
    with ServerThread(config, wait_ready=False) as running, running.channel() as chan:
        _metadata(chan)  # the files are read; the weights are loading
        early = BackgroundGenerate(chan, prompts[0], max_tokens=4, ignore_eos=True, timeout=60)
        time.sleep(1.0)
        assert early.is_alive()  # waiting for the model, not refused
        running.run(running.server.wait_ready(120))
        early.join(60)
    outcome = early.outcome
    assert outcome is not None and outcome.error is None, outcome
    assert outcome.complete is not None and outcome.complete.completion_tokens == 4
    # While it waited, the stream got empty chunks (liveness for the router), no tokens.
    assert not outcome.chunks[0].token_ids and outcome.tokens[:4] == outcome.tokens


def test_a_bad_request_while_loading_is_refused_at_once(demo_dir, prompts):
    config = _with_faults(demo_dir, "load:6")
    with ServerThread(config, wait_ready=False) as running, running.channel() as chan:
        _metadata(chan)
        # Refused at once: a call that waited for the load would pass its deadline instead.
        bad = generate(chan, prompts[0], max_tokens=2, temperature=-1, timeout=3)
        assert bad.code == grpc.StatusCode.INVALID_ARGUMENT and not bad.chunks
        running.run(running.server.wait_ready(120))


def test_a_request_waits_no_longer_than_the_load_wait(demo_dir, prompts):
    config = _with_faults(demo_dir, "load:6")
    config = replace(config, handlers=replace(config.handlers, max_load_wait_s=0.5))
    with ServerThread(config, wait_ready=False) as running, running.channel() as chan:
        _metadata(chan)
        early = generate(chan, prompts[0], max_tokens=2, timeout=5)  # the load takes 6 s
        assert early.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "still loading" in early.error.details()
        running.run(running.server.wait_ready(120))


def test_metadata_calls_wait_while_the_files_are_resolved(demo_dir):
    config = _with_faults(demo_dir, "resolve:5;load:2")
    with ServerThread(config, wait_ready=False) as running, running.channel() as chan:
        stub = pb_grpc.MlxEngineStub(chan)
        with pytest.raises(grpc.RpcError) as short:  # a deadline shorter than the wait
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=0.5)
        assert short.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        with pytest.raises(grpc.RpcError) as starting:  # a router must not register it yet
            stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert starting.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "resolved" in starting.value.details()
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        reply = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)  # loading: an answer
        assert not reply.healthy and "still loading" in reply.message
        assert info.served_model_name == str(demo_dir)
        assert not _serving(chan)


@pytest.mark.parametrize("kind", ["llama", "hybrid", "gemma3"])
def test_file_metadata_matches_what_mlx_lm_loads(kind):
    from mlx_lm import load

    files = prepare_model_files(ModelSpec(f"demo:{kind}"))
    model_dir = demo_model_path(kind)
    _, tokenizer = load(str(model_dir))
    info = files.info
    assert info.model_dir == str(model_dir)
    assert info.served_model_name == f"mlx-grpc-worker-demo-{kind}"
    assert info.eos_token_ids == tuple(sorted(tokenizer.eos_token_ids))
    assert info.bos_token_id == tokenizer.bos_token_id
    assert info.pad_token_id == tokenizer.pad_token_id
    assert info.vocab_size == 512
    assert files.tokenizer.encode("The river") == tokenizer.encode("The river")


def test_an_unknown_demo_kind_or_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown demo model 'nope'"):
        prepare_model_files(ModelSpec("demo:nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        prepare_model_files(ModelSpec(str(tmp_path / "missing")))
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        prepare_model_files(ModelSpec(str(tmp_path)))
