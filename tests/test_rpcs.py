"""The non-generating RPCs: model and server info, health (both kinds), reflection, tokenizer."""

from __future__ import annotations

import hashlib
import io
import json
import random
import zipfile

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import ServerThread, generate

from servicer.proto import common_pb2
from servicer.proto import mlx_engine_pb2 as pb
from servicer.proto import mlx_engine_pb2_grpc as pb_grpc
from servicer.tokenizer_bundle import CHUNK_BYTES, build_archive

ENGINE = "mlx.grpc.engine.MlxEngine"


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_model_info_comes_from_the_config_and_tokenizer(channel, demo_dir, reference):
    info = pb_grpc.MlxEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    config = json.loads((demo_dir / "config.json").read_text())
    tokenizer = reference.tokenizer
    assert info.model_path == str(demo_dir)
    assert info.served_model_name == str(demo_dir)
    assert info.is_generation
    assert info.max_context_length == config["max_position_embeddings"]
    assert info.max_req_input_len == config["max_position_embeddings"] - 1
    assert info.vocab_size == config["vocab_size"]
    assert info.model_type == "llama"
    assert list(info.architectures) == config["architectures"]
    assert list(info.eos_token_ids) == [tokenizer.eos_token_id]
    assert info.bos_token_id == tokenizer.bos_token_id
    assert info.pad_token_id == tokenizer.pad_token_id


def test_server_info(channel):
    info = pb_grpc.MlxEngineStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.server_type == "mlx-grpc-worker"
    assert info.active_requests == 0
    assert info.uptime_seconds > 0


def test_health_services_report_serving(channel):
    assert _health(channel, "") == health_pb2.HealthCheckResponse.SERVING
    assert _health(channel, ENGINE) == health_pb2.HealthCheckResponse.SERVING
    reply = pb_grpc.MlxEngineStub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert reply.healthy


def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in response.list_services_response.service}
    assert {ENGINE, "grpc.health.v1.Health"} <= names


def test_get_tokenizer_streams_a_verified_zip(channel, demo_dir):
    chunks = list(
        pb_grpc.MlxEngineStub(channel).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30)
    )
    assert chunks and all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert all(c.sha256 == "" for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
        assert "model.safetensors" not in names
        assert archive.read("tokenizer.json") == (demo_dir / "tokenizer.json").read_bytes()


def test_archive_chunks_large_tokenizers_and_is_stable(tmp_path):
    incompressible = random.Random(0).randbytes(300 * 1024)
    (tmp_path / "tokenizer.json").write_bytes(incompressible)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    first, second = build_archive(tmp_path), build_archive(tmp_path)
    assert first == second  # same files, same archive, same digest
    pieces = list(first.chunks())
    assert len(pieces) > 1 and all(len(p) <= CHUNK_BYTES for p in pieces)
    assert b"".join(pieces) == first.data
    with zipfile.ZipFile(io.BytesIO(first.data)) as archive:
        assert set(archive.namelist()) == {
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        }


def test_not_serving_until_the_engine_is_warm(demo_dir, prompts):
    from conftest import demo_config

    with (
        ServerThread(demo_config(demo_dir), wait_ready=False) as running,
        running.channel() as chan,
    ):
        stub = pb_grpc.MlxEngineStub(chan)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # the files are read
        assert _health(chan, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(chan, ENGINE) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
        early = generate(chan, prompts[0], max_tokens=2, timeout=1.0)  # waits, then refused
        assert early.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        running.run(running.server.wait_ready(120))
        assert _health(chan, "") == health_pb2.HealthCheckResponse.SERVING
        assert _health(chan, ENGINE) == health_pb2.HealthCheckResponse.SERVING
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
        assert generate(chan, prompts[0], max_tokens=2, ignore_eos=True).error is None
