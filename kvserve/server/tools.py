"""A chat request's ``tools`` and ``tool_choice`` -> how its output is constrained and read, each error a 400.

- ``none`` (or no tools): plain chat; the tools are not put in the prompt.
- a named function: the output *is* that function's arguments, constrained to its ``parameters`` schema.
- ``required``: the output is a JSON array of ``{"name", "arguments"}`` calls, constrained so each names a
  tool and its arguments match that tool's schema (one call unless ``parallel_tool_calls``).
- ``auto`` (the default with tools): the model writes calls in its own syntax, as its chat template taught
  it, and ``server/tool_parsers.py`` reads them out; text outside calls is content.

The two constrained cases use the structured-output engine (xgrammar), so their arguments always parse and
match the schema; vLLM does the same.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvserve.platform.extras import MissingExtraError
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest, ChatTool
from kvserve.server.tool_parsers import ParsedCall, ParsedOutput, parse
from kvserve.structured import GuidedDecodingParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # OpenAI's shape, as chat templates read them
    parser: str  # "named", "json" (required) or the model's syntax (auto)
    named: str | None = None
    guided: GuidedDecodingParams | None = None
    parallel: bool = True

    def read(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls in ``text`` (the output so far; ``final`` once it ended)."""
        if self.parser == "named":
            return ParsedOutput("", [ParsedCall(self.named, text, final)])
        parsed = parse(self.parser, text, final)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def call_id(self) -> str:
        # Mistral's templates refuse ids that are not 9 letters or digits.
        return uuid.uuid4().hex[:9] if self.parser == "mistral" else f"call_{uuid.uuid4().hex[:24]}"


def tool_plan(body: ChatCompletionRequest, auto_parser: str) -> ToolPlan | None:
    """None when the request asks for no tool calls; ``auto_parser`` is the server's syntax for ``auto``."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: the request lists no tools to choose from", "tool_choice")
    names = _check_tools(tools)
    if not tools or choice == "none":
        return None
    if choice not in (None, "auto") and _other_constraint(body):
        raise bad_request(
            f"tool_choice {_describe(choice)} constrains the output itself; drop {_other_constraint(body)}",
            "tool_choice",
        )
    as_dicts = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice is None or choice == "auto":
        return ToolPlan(as_dicts, auto_parser, parallel=body.parallel_tool_calls)
    if choice == "required":
        schema = _calls_schema(tools, body.parallel_tool_calls)
        return ToolPlan(as_dicts, "json", guided=_guided(schema, "tools"), parallel=body.parallel_tool_calls)
    name = choice.function.name
    if name not in names:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})",
            "tool_choice.function.name",
        )
    parameters = tools[names.index(name)].function.parameters or _ANY_OBJECT
    return ToolPlan(as_dicts, "named", named=name, guided=_guided(parameters, "tools"))


def _check_tools(tools: list[ChatTool]) -> list[str]:
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function"
        name = tool.function.name
        if not _NAME.match(name):
            raise bad_request(
                f"{where}.name must be 1-64 letters, digits, underscores or dashes, got {name!r}", f"{where}.name"
            )
        if name in names:
            raise bad_request(f"{where}.name: two tools are named {name!r}", f"{where}.name")
        names.append(name)
        if tool.function.parameters is not None:
            _guided(tool.function.parameters, f"{where}.parameters")  # a schema xgrammar cannot take is a 400 now
    return names


def _calls_schema(tools: list[ChatTool], parallel: bool) -> dict:
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _ANY_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _guided(schema: dict, param: str) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(json=schema)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    except MissingExtraError as exc:
        raise bad_request(f"tool calls need structured output on this server: {exc}", param) from None


def _other_constraint(body: ChatCompletionRequest) -> str | None:
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            return name
    fmt = body.response_format
    return "response_format" if fmt is not None and fmt.type != "text" else None


def _describe(choice: object) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"
