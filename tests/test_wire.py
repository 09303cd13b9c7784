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
from wire_samples import FIRST_EXTENSION, sample_dicts, strip_extensions

from servicer.proto import common_pb2, mlx_engine_pb2, vllm_engine_pb2

sys.path.insert(0, str(ROOT / "proto"))
from generate import PACKAGE_DIR, generate

OUR_FILES = {
    "mlx_engine.proto": mlx_engine_pb2.DESCRIPTOR,
    "vllm_engine.proto": vllm_engine_pb2.DESCRIPTOR,
    "common.proto": common_pb2.DESCRIPTOR,
}

# Runs in its own interpreter: smg_grpc_proto registers the same proto names as ours.
REFERENCE_SIDE = textwrap.dedent(
    """
    import json, sys
    from google.protobuf import descriptor_pool, json_format, message_factory
    from smg_grpc_proto.generated import common_pb2, mlx_engine_pb2, vllm_engine_pb2

    job = json.load(sys.stdin)
    pool = descriptor_pool.Default()
    out = {"files": {}, "messages": {}}
    for module in (common_pb2, mlx_engine_pb2, vllm_engine_pb2):
        out["files"][module.DESCRIPTOR.name] = module.DESCRIPTOR.serialized_pb.hex()
    for name, item in job.items():
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        decoded = [cls.FromString(bytes.fromhex(b)) for b in item["bytes"]]
        out["messages"][name] = {
            "decoded": [
                json_format.MessageToDict(m, preserving_proto_field_name=True) for m in decoded
            ],
            "reencoded": [m.SerializeToString(deterministic=True).hex() for m in decoded],
            "encoded": [
                json_format.ParseDict(s, cls()).SerializeToString(deterministic=True).hex()
                for s in item["their_samples"]
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
            "their_samples": sample_dicts(desc, limit=FIRST_EXTENSION),
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


def _router_view(message: descriptor_pb2.DescriptorProto) -> descriptor_pb2.DescriptorProto:
    """Our message without its extension fields (and oneofs left empty by that)."""
    view = descriptor_pb2.DescriptorProto()
    view.CopyFrom(message)
    del view.field[:]
    view.field.extend(f for f in message.field if f.number < FIRST_EXTENSION)
    used = sorted({f.oneof_index for f in view.field if f.HasField("oneof_index")})
    del view.oneof_decl[:]
    view.oneof_decl.extend(message.oneof_decl[i] for i in used)
    for f in view.field:
        if f.HasField("oneof_index"):
            f.oneof_index = used.index(f.oneof_index)
    return view


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
            view = _router_view(message)
            assert view == their_messages[message.name], f"{name}: {message.name} differs"
        assert list(our_proto.service) == list(theirs.service)
        assert list(our_proto.enum_type) == list(theirs.enum_type)
        assert [m.name for m in our_proto.message_type] == [m.name for m in theirs.message_type]
    mlx = descriptor_pb2.FileDescriptorProto.FromString(
        bytes.fromhex(reference_side["files"]["mlx_engine.proto"])
    )
    ours = descriptor_pb2.FileDescriptorProto.FromString(mlx_engine_pb2.DESCRIPTOR.serialized_pb)
    assert [m.name for m in ours.message_type] == [m.name for m in mlx.message_type]


def test_fields_the_router_lacks_are_numbered_from_100(reference_side):
    theirs = {}
    for hexed in reference_side["files"].values():
        for message in descriptor_pb2.FileDescriptorProto.FromString(
            bytes.fromhex(hexed)
        ).message_type:
            theirs[message.name] = {f.number for f in message.field}
    added = []
    for desc in _our_messages():
        for field in desc.fields:
            if field.number not in theirs[desc.name]:
                assert field.number >= FIRST_EXTENSION, f"{desc.name}.{field.name}"
                added.append(f"{desc.name}.{field.name}")
    assert "SamplingParams.stop" in added


def test_every_message_round_trips_both_ways(reference_side):
    checked = 0
    for desc in _our_messages():
        cls = message_factory.GetMessageClass(desc)
        item = reference_side["job"][desc.full_name]
        theirs = reference_side["messages"][desc.full_name]
        for sample, our_bytes, decoded, reencoded in zip(
            item["samples"], item["bytes"], theirs["decoded"], theirs["reencoded"], strict=True
        ):
            ours = json_format.ParseDict(sample, cls())
            assert ours.ListFields() or not desc.fields, f"{desc.full_name}: empty sample"
            # ours -> theirs: they read every field they know and ignore our extensions...
            assert decoded == _to_dict(strip_extensions(cls.FromString(bytes.fromhex(our_bytes))))
            # ...and keep them intact when they pass the message on.
            assert bytes.fromhex(reencoded) == bytes.fromhex(our_bytes), desc.full_name
            checked += 1
        for sample, encoded in zip(item["their_samples"], theirs["encoded"], strict=True):
            # theirs -> ours: byte-identical encoding, and we read everything back.
            ours = json_format.ParseDict(sample, cls())
            assert _to_dict(cls.FromString(bytes.fromhex(encoded))) == _to_dict(ours)
            assert bytes.fromhex(encoded) == ours.SerializeToString(deterministic=True)
            checked += 1
    assert checked >= 40
