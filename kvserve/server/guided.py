"""A request's structured-output fields -> ``GuidedDecodingParams``, each error a 400 naming its field.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` ask for the same thing; at most one may be set.
"""

from __future__ import annotations

from kvserve.platform.extras import MissingExtraError
from kvserve.server.errors import bad_request
from kvserve.server.protocol import _SamplingFields
from kvserve.structured import GuidedDecodingParams

_GUIDED_FIELDS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
}  # fmt: skip


def guided_params(body: _SamplingFields) -> GuidedDecodingParams | None:
    asked = {name: kind for name, kind in _GUIDED_FIELDS.items() if getattr(body, name) is not None}
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        asked["response_format"] = fmt.type
    if len(asked) > 1:
        names = ", ".join(asked)
        raise bad_request(f"only one structured output constraint may be set per request, got {names}", names)
    if not asked:
        return None
    ((field, kind),) = asked.items()
    try:
        if field != "response_format":
            return GuidedDecodingParams(**{kind: getattr(body, field)})
        if kind == "json_object":
            return GuidedDecodingParams(json_object=True)
        return GuidedDecodingParams(json=_response_schema(body))
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field) from None
    except MissingExtraError as exc:  # a server installed without kvserve[structured]
        raise bad_request(f"{field} is not available on this server: {exc}", field) from None


def _response_schema(body: _SamplingFields) -> dict:
    spec = body.response_format.json_schema
    if spec is None or spec.json_schema is None:
        field = "response_format.json_schema" + ("" if spec is None else ".schema")
        raise bad_request(f'response_format of type "json_schema" needs {field}', field)
    return spec.json_schema
