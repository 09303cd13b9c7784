"""The wire: our generated code is fresh, and our messages are the router's, byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, json_format, message_factory
from support import ROOT
from wire_samples import sample_dicts

from servicer.proto import common_pb2, mlx_engine_pb2

sys.path.insert(0, str(ROOT / "proto"))
from generate import PACKAGE_DIR, generate

OUR_FILES = {"mlx_engine.proto": mlx_engine_pb2.DESCRIPTOR, "common.proto": common_pb2.DESCRIPTOR}

# Runs in its own interpreter: smg_grpc_proto registers the same proto names as ours.
REFERENCE_SIDE = textwrap.dedent(
    """
    import json, sys
    from google.protobuf import descriptor_pool, json_format, message_factory
    from smg_grpc_proto.generated import common_pb2, mlx_engine_pb2

    job = json.load(sys.stdin)
    pool = descriptor_pool.Default()
    out = {"files": {}, "messages": {}}
    for module in (common_pb2, mlx_engine_pb2):
        out["files"][module.DESCRIPTOR.name] = module.DESCRIPTOR.serialized_pb.hex()
    for name, item in job.items():
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        out["messages"][name] = {
            "decoded": [
                json_format.MessageToDict(
                    cls.FromString(bytes.fromhex(b)), preserving_proto_field_name=True
                )
                for b in item["bytes"]
            ],
            "encoded": [
                json_format.ParseDict(s, cls()).SerializeToString(deterministic=True).hex()
                for s in item["samples"]
            ],
        }
    json.dump(out, sys.stdout)
    """
)


def _our_messages():
    for file in OUR_FILES.values():
        yield from file.message_types_by_name.values()


def _to_dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


@pytest.fixture(scope="module")
def reference_side() -> dict:
    job = {}
    for desc in _our_messages():
        cls = message_factory.GetMessageClass(desc)
        samples = sample_dicts(desc)
        job[desc.full_name] = {
            "samples": samples,
            "bytes": [
                json_format.ParseDict(s, cls()).SerializeToString(deterministic=True).hex()
                for s in samples
            ],
        }
    result = subprocess.run(
        [sys.executable, "-c", REFERENCE_SIDE],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT / "tests",
    )
    return {"job": job, **json.loads(result.stdout)}


def test_generated_code_is_fresh(tmp_path: Path):
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    committed = {
        p.name: p.read_bytes() for p in PACKAGE_DIR.iterdir() if p.suffix in (".py", ".pyi")
    }
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `make proto`: {stale} differ from proto/*.proto"


def test_every_message_and_the_service_match_the_reference_definitions(reference_side):
    for name, ours in OUR_FILES.items():
        theirs = descriptor_pb2.FileDescriptorProto.FromString(
            bytes.fromhex(reference_side["files"][name])
        )
        our_proto = descriptor_pb2.FileDescriptorProto.FromString(ours.serialized_pb)
        assert our_proto.package == theirs.package
        assert list(our_proto.dependency) == list(theirs.dependency)
        their_messages = {m.name: m for m in theirs.message_type}
        for message in our_proto.message_type:
            assert message == their_messages[message.name], f"{name}: {message.name} differs"
        assert list(our_proto.service) == list(theirs.service)
    mlx = descriptor_pb2.FileDescriptorProto.FromString(
        bytes.fromhex(reference_side["files"]["mlx_engine.proto"])
    )
    ours = descriptor_pb2.FileDescriptorProto.FromString(mlx_engine_pb2.DESCRIPTOR.serialized_pb)
    assert [m.name for m in ours.message_type] == [m.name for m in mlx.message_type]


def test_every_message_round_trips_both_ways(reference_side):
    checked = 0
    for desc in _our_messages():
        cls = message_factory.GetMessageClass(desc)
        item = reference_side["job"][desc.full_name]
        theirs = reference_side["messages"][desc.full_name]
        for sample, our_bytes, decoded, encoded in zip(
            item["samples"], item["bytes"], theirs["decoded"], theirs["encoded"], strict=True
        ):
            ours = json_format.ParseDict(sample, cls())
            assert ours.ListFields() or not desc.fields, f"{desc.full_name}: empty sample"
            # ours -> theirs
            assert decoded == _to_dict(ours), desc.full_name
            # theirs -> ours
            assert _to_dict(cls.FromString(bytes.fromhex(encoded))) == _to_dict(ours)
            assert bytes.fromhex(encoded) == bytes.fromhex(our_bytes), desc.full_name
            checked += 1
    assert checked >= 20
