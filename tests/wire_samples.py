"""Fully populated sample messages, built from a descriptor alone.

Imported both by the tests (with our generated classes) and by a subprocess that loads
smg_grpc_proto's classes: the two sets of .proto files register the same names, so they
cannot share one process.
"""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_SCALARS: dict[int, Any] = {
    FieldDescriptor.TYPE_STRING: "text-é",
    FieldDescriptor.TYPE_BYTES: base64.b64encode(b"\x00\xffbytes").decode(),
    FieldDescriptor.TYPE_BOOL: True,
    FieldDescriptor.TYPE_INT32: -7,
    FieldDescriptor.TYPE_SINT32: -7,
    FieldDescriptor.TYPE_SFIXED32: -7,
    FieldDescriptor.TYPE_UINT32: 4_000_000_000,
    FieldDescriptor.TYPE_FIXED32: 4_000_000_000,
    FieldDescriptor.TYPE_INT64: "-9000000000",
    FieldDescriptor.TYPE_SINT64: "-9000000000",
    FieldDescriptor.TYPE_SFIXED64: "-9000000000",
    FieldDescriptor.TYPE_UINT64: "18000000000000000000",
    FieldDescriptor.TYPE_FIXED64: "18000000000000000000",
    FieldDescriptor.TYPE_FLOAT: 1.25,  # exact in float32, so it survives the round trip
    FieldDescriptor.TYPE_DOUBLE: -2.5,
}


def _real_oneofs(desc: Descriptor) -> list:
    # proto3 `optional` fields sit in a synthetic one-field oneof named "_<field>".
    return [o for o in desc.oneofs if not (len(o.fields) == 1 and o.name == f"_{o.fields[0].name}")]


FIRST_EXTENSION = 100  # our own fields are numbered from here; the router's stay below


def _value(field: FieldDescriptor, depth: int, limit: int | None) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return sample_dicts(field.message_type, depth + 1, limit)[0]
    if field.type == FieldDescriptor.TYPE_ENUM:
        values = field.enum_type.values
        return values[min(1, len(values) - 1)].name
    return _SCALARS[field.type]


def _field_value(field: FieldDescriptor, depth: int, limit: int | None) -> Any:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key_field, value_field = message.fields_by_name["key"], message.fields_by_name["value"]
        keys = ["3", "-4"] if key_field.type != FieldDescriptor.TYPE_STRING else ["a", "b"]
        return {k: _value(value_field, depth, limit) for k in keys}
    if field.is_repeated:
        return [_value(field, depth, limit), _value(field, depth, limit)]
    return _value(field, depth, limit)


def sample_dicts(
    desc: Descriptor, depth: int = 0, limit: int | None = None
) -> list[dict[str, Any]]:
    """One dict (json_format, proto field names) per choice of each real oneof; with `limit`,
    only fields numbered below it (what an older peer knows)."""
    fields = [f for f in desc.fields if limit is None or f.number < limit]
    oneofs = [o for o in _real_oneofs(desc) if any(f in fields for f in o.fields)]
    in_oneof = {f.name for o in oneofs for f in o.fields}
    base = {
        f.name: _field_value(f, depth, limit)
        for f in fields
        if f.name not in in_oneof and depth < 4
    }
    if not oneofs or depth >= 4:
        return [base]
    samples = []
    for oneof in oneofs:
        for choice in oneof.fields:
            if choice not in fields:
                continue
            sample = dict(base)
            for other in oneofs:  # every other oneof takes its first field
                pick = choice if other is oneof else other.fields[0]
                sample[pick.name] = _field_value(pick, depth, limit)
            samples.append(sample)
    return samples


def strip_extensions(message: Any) -> Any:
    """Clear every field numbered from 100, recursively: the message an older peer sees."""
    for field, value in message.ListFields():
        if field.number >= FIRST_EXTENSION:
            message.ClearField(field.name)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            entry = field.message_type.GetOptions().map_entry
            if field.is_repeated and not entry:
                for item in value:
                    strip_extensions(item)
            elif not field.is_repeated:
                strip_extensions(value)
    return message
