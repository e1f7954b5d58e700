"""Request bodies into Structs: the media type, the nesting depth and msgspec's validation,
each refused as a 4xx that names the field at fault (with a "did you mean" for a typo)."""

from __future__ import annotations

import re

import msgspec
from starlette.requests import Request

from frontend.base.errors import APIError
from frontend.http.field_hints import closest_field
from frontend.input.input_bounds import json_depth_error
from frontend.input.json_depth import TooDeep, check_depth


def _check_media_type(request: Request) -> None:
    """A body sent as something other than JSON (curl -d's form encoding, say) is a 415, as
    in vLLM; with no Content-Type at all the body is read as JSON."""
    given = request.headers.get("content-type")
    if given is None:
        return
    media_type = given.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Unsupported Media Type {media_type!r}: send the body as "
                            "application/json")


async def decode_body(request: Request, body_type, max_json_depth: int):
    _check_media_type(request)
    body = await request.body()
    try:
        # Before msgspec, which recurses per level (and every walk after it): a flat scan.
        check_depth(body, max_json_depth)
        return msgspec.json.decode(body, type=body_type)
    except TooDeep as exc:
        raise json_depth_error(exc) from exc
    except msgspec.ValidationError as exc:
        raise APIError(400, f"Invalid request: {exc}{_hint(body_type, str(exc))}",
                       _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the scan should have stopped it; never a 500
        raise APIError(400, "The request body nests too deeply") from exc


_FIELD_PROBLEM = re.compile(r"Object (?:contains unknown|missing required) field `([^`]*)`")


def _param_of(message: str) -> str | None:
    """The request field a msgspec validation error is about, as a dotted path.

    msgspec says e.g. "Object contains unknown field `temprature` - at `$`",
    "Expected `int`, got `str` - at `$.n`" or "... - at `$.messages[0]`".
    """
    path = ""
    if " - at `$" in message:
        path = message.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".")
    named = _FIELD_PROBLEM.match(message)
    if named:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$([^`]*)`)?")


def _hint(body_type, message: str) -> str:
    """For an unknown field: the closest known one at the same place, if any is close."""
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown is None:
        return ""
    known = closest_field(body_type, (unknown.group(2) or "").lstrip("."), unknown.group(1))
    return f' (did you mean "{known}"?)' if known else ""
