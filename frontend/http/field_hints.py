"""The closest known field to an unknown one, for the 400 an unknown field gets (req P-1
keeps the 400; the hint saves the user a trip to the docs: `did you mean "max_tokens"?`)."""

from __future__ import annotations

import difflib
import re

import msgspec.inspect as mi

_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def closest_field(body_type, path: str, unknown: str) -> str | None:
    """The known field nearest to `unknown` in the object at `path` ("" for the body,
    "messages[0]" ...) of a request of `body_type`; None when nothing is close."""
    names = sorted({name for info in _types_at(mi.type_info(body_type), path)
                    for name in _field_names(info)})
    match = difflib.get_close_matches(unknown, names, n=1, cutoff=0.6)
    return match[0] if match else None


def _types_at(info: mi.Type, path: str) -> list[mi.Type]:
    """Every type the value at `path` may have (a union gives several)."""
    current = _alternatives(info)
    for name, index in _SEGMENT.findall("." + path if path and path[0] != "[" else path):
        following: list[mi.Type] = []
        for t in current:
            if name and isinstance(t, mi.StructType):
                following += [f.type for f in t.fields if f.encode_name == name]
            elif index and isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType):
                following.append(t.item_type)
            elif name and isinstance(t, mi.DictType):
                following.append(t.value_type)
        current = [a for t in following for a in _alternatives(t)]
    return current


def _alternatives(info: mi.Type) -> list[mi.Type]:
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        return [a for t in info.types for a in _alternatives(t)]
    return [info]


def _field_names(info: mi.Type) -> list[str]:
    return [f.encode_name for f in info.fields] if isinstance(info, mi.StructType) else []
