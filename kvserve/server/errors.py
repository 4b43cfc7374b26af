"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from kvserve.server.fields import unsupported_message
from kvserve.server.protocol import ErrorInfo, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "bytes"})
_GENERIC_TAG = re.compile(r"^(list|dict|tuple|set|literal|function-\w+)\[")


class ApiError(Exception):
    """Raised by a handler; the app turns it into an error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_validation_errors(errors: Sequence[Mapping]) -> ApiError:
    """A 400 for pydantic/FastAPI validation errors, naming the first offending field in ``param``."""
    if not errors:
        return bad_request("the request is not valid")
    first = errors[0]
    loc = _field_loc(first)
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}")
    if not loc:
        if first.get("type") == "missing":
            return bad_request("the request needs a JSON object body")
        return bad_request(f"the request body must be a JSON object: {first.get('msg', '')}")
    param = loc[0]
    if first.get("type") == "extra_forbidden":
        return bad_request(unsupported_message(_format_loc(loc)), _format_loc(loc))
    # A union field (prompt, content) fails once per member it tried: say each way it failed.
    same = [e for e in errors if _field_loc(e)[:1] == [param]]
    details = list(dict.fromkeys(f"{_format_loc(_field_loc(e))}: {e.get('msg', 'invalid value')}" for e in same))
    got = "" if first.get("type") == "missing" else f" (got {_short(_top_input(first, same))})"
    return bad_request("; ".join(details[:3]) + got, param)


def _field_loc(error: Mapping) -> list[str]:
    return [str(part) for part in error.get("loc", ()) if part != "body" and not _is_union_tag(str(part))]


def _top_input(first: Mapping, same: Sequence[Mapping]) -> object:
    """The value the client sent for the field (the shortest loc's input is the least nested)."""
    return min(same, key=lambda e: len(e.get("loc", ()))).get("input", first.get("input"))


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union it tried (``str``, ``list[int]``, ``TextPart``) in ``loc``."""
    return part in _TYPE_NAMES or _GENERIC_TAG.match(part) is not None or part[:1].isupper()


def _format_loc(loc: list[str]) -> str:
    out = loc[0]
    for part in loc[1:]:
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
