"""Tool calls read out of a model's text, one parser per syntax a chat template teaches its model.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes, Qwen2.5,
  Qwen3, SmolLM; also what kvserve writes into the prompt for a template that does not render tools);
- ``llama3_json``: Llama 3.1+'s ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or alone),
  several joined by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``pythonic``: a Python list of calls with keyword arguments, ``[get_weather(city="Paris"), f(x=1)]`` (the
  format Google documents for Gemma, Llama 3.2's and 4's; also kvserve's prompt for a Gemma template, which
  renders no tools), optionally in a ````` ```tool_code ````` fence; its calls are sent whole, once the list closes;
- ``json``: a JSON array of ``{"name", "arguments"}`` objects and nothing else: what ``tool_choice: required``
  constrains the output to.

``parse(text, final)`` works on the text so far: while streaming (``final=False``) it returns the content that
can no longer turn out to be the start of a call, and each call's arguments as the raw text written so far, so
a stream sends the arguments as fragments whose concatenation is the final arguments' text. Text outside calls
is content. A call whose JSON does not parse at the end stays content, as the model wrote it.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from kvserve.text.tool_prompt import SYNTAXES, prompt_syntax, renders_tools

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "json")
CHOICES = PARSERS[:-1]  # what --tool-call-parser takes: ``json`` is ``required``'s own


@dataclass
class ParsedCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # raw JSON text of the arguments so far ("" before they start)
    complete: bool


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def parse(parser: str, text: str, final: bool) -> ParsedOutput:
    if parser == "hermes":
        return _tagged(text, final, "<tool_call>", "</tool_call>")
    if parser == "llama3_json":
        return _llama3(text, final)
    if parser == "mistral":
        return _mistral(text, final)
    if parser == "pythonic":
        return _pythonic(text, final)
    if parser == "json":
        return _array(text, final, 0) or ParsedOutput(text)
    raise ValueError(f"unknown tool call parser {parser!r}; choose one of {', '.join(PARSERS)}")


def check_parser(parser: str | None, chat_template: str | None) -> None:
    """A ValueError naming the problem, for a parser the server cannot use with this template."""
    if parser is None:
        return
    if parser not in CHOICES:
        raise ValueError(f"tool call parser {parser!r} is not one of {', '.join(CHOICES)}")
    if not renders_tools(chat_template) and parser not in SYNTAXES:
        raise ValueError(
            f"tool call parser {parser!r}: the chat template renders no tools, so kvserve writes the tool prompt "
            f"itself, in {' or '.join(SYNTAXES)} syntax"
        )


def detect_parser(chat_template: str | None) -> str:
    """The syntax a chat template teaches; for one that renders no tools, the syntax of kvserve's own prompt."""
    template = chat_template or ""
    if not renders_tools(template):
        return prompt_syntax(template)
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template:
        return "pythonic"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eom_id|>" in template):
        return "llama3_json"
    return "hermes"


# ----- formats -----


def _tagged(text: str, final: bool, begin: str, end: str) -> ParsedOutput:
    content, calls, i = [], [], 0
    while True:
        start = text.find(begin, i)
        if start < 0:
            rest = text[i:]
            content.append(rest if final else rest[: len(rest) - _held_back(rest, begin)])
            break
        obj = _call_object(text, _skip_ws(text, start + len(begin)))
        if final and (obj is None or not obj.call.complete):  # a malformed block stays text
            content.append(text[i:])
            break
        content.append(text[i:start])
        if obj is None:  # while streaming: the block's object has not started (or is not one yet)
            break
        calls.append(obj.call)
        if obj.end is None:
            break
        stop = text.find(end, obj.end)
        if stop < 0:
            if not final:  # wait for the closing tag; a model that stops without one still made the call
                break
            i = obj.end
        else:
            i = stop + len(end)
    return ParsedOutput("".join(content), calls)


def _llama3(text: str, final: bool) -> ParsedOutput:
    if not final and "<|python_tag|>".startswith(text):
        return ParsedOutput("")
    body = text.removeprefix("<|python_tag|>")
    start = _skip_ws(body, 0)
    if start == len(body):
        return ParsedOutput(text if final else "")
    if body[start] != "{":
        return ParsedOutput(text)
    calls, i = [], start
    while True:
        obj = _call_object(body, i, ("parameters", "arguments"))
        if obj is None or (final and not obj.call.complete):
            return ParsedOutput(text) if final else ParsedOutput("", calls + ([obj.call] if obj else []))
        calls.append(obj.call)
        if obj.end is None:
            return ParsedOutput("", calls)
        i = _skip_ws(body, obj.end)
        if i < len(body) and body[i] == ";":
            i = _skip_ws(body, i + 1)
        if i == len(body):
            return ParsedOutput("", calls)
        if body[i] != "{":
            return ParsedOutput(text) if final else ParsedOutput("", calls)


def _mistral(text: str, final: bool) -> ParsedOutput:
    marker = "[TOOL_CALLS]"
    at = text.find(marker)
    if at < 0:  # the marker is a control token that decoding may drop: a bare array of calls counts too
        if text.lstrip().startswith("["):
            return _array(text, final, 0) or ParsedOutput(text)
        return ParsedOutput(text if final else text[: len(text) - _held_back(text, marker)])
    parsed = _array(text, final, at + len(marker))
    if parsed is None:
        return ParsedOutput(text if final else text[:at])
    return ParsedOutput(text[:at] + parsed.content, parsed.calls)


_FENCE = re.compile(r"^\s*```(?:tool_code|python)?\s*\n?(.*?)\n?\s*(```\s*)?$", re.DOTALL)


def _pythonic(text: str, final: bool) -> ParsedOutput:
    stripped = text.strip()
    fenced = _FENCE.match(text)
    body = (fenced.group(1) if fenced else stripped).strip()
    calls = _python_calls(body) if body.startswith("[") else None
    if final:
        return ParsedOutput("", calls) if calls else ParsedOutput(text)
    # While streaming, a list (or a fence that may hold one) is held back until it parses: its calls go whole.
    if fenced or body.startswith("[") or "```tool_code".startswith(stripped[:12]):
        return ParsedOutput("", calls or [])
    return ParsedOutput(text)


def _python_calls(body: str) -> list[ParsedCall] | None:
    """``[f(a=1), g(b="x")]`` -> its calls, arguments as JSON; None unless every item is such a call."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for item in tree.elts:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg is not None}
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError):
            return None
        calls.append(ParsedCall(item.func.id, text, True))
    return calls


def _array(text: str, final: bool, i: int) -> ParsedOutput | None:
    """A JSON array of call objects starting at ``text[i:]`` (after whitespace); None if it is not one."""
    i = _skip_ws(text, i)
    if i == len(text):
        return None if final else ParsedOutput("")
    if text[i] != "[":
        return None
    calls, i = [], _skip_ws(text, i + 1)
    while i < len(text):
        obj = _call_object(text, i)
        if obj is None:
            return None
        if final and not obj.call.complete:
            return None
        calls.append(obj.call)
        if obj.end is None:
            return ParsedOutput("", calls)
        i = _skip_ws(text, obj.end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < len(text) and text[i] == "]":
            return ParsedOutput(text[i + 1 :] if final else "", calls)
    return None if final else ParsedOutput("", calls)


# ----- one call object, read while it is being written -----


@dataclass
class _CallObject:
    call: ParsedCall
    end: int | None  # index after the closing brace; None while incomplete


def _call_object(text: str, i: int, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> _CallObject | None:
    """``{"name": ..., "arguments": ...}`` at ``text[i]``; None if no object starts there (or not yet)."""
    if i >= len(text) or text[i] != "{":
        return None
    name, arguments, args_done = None, "", False
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            return _CallObject(ParsedCall(name, arguments, False), None)
        if text[j] == "}":
            done = name is not None and args_done
            return _CallObject(ParsedCall(name, arguments or "{}", done), j + 1) if done else None
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            return None
        key_end = _value_end(text, j)
        if key_end is None:
            return _CallObject(ParsedCall(name, arguments, False), None)
        key = json.loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j >= len(text):
            return _CallObject(ParsedCall(name, arguments, False), None)
        if text[j] != ":":
            return None
        value_start = _skip_ws(text, j + 1)
        value_end = _value_end(text, value_start)
        if key == "name":
            if value_end is not None:
                name = json.loads(text[value_start:value_end])
                if not isinstance(name, str):
                    return None
        elif key in argument_keys:
            arguments = text[value_start : len(text) if value_end is None else value_end]
            args_done = value_end is not None
            if args_done and not _is_json_object(arguments):
                return None
        if value_end is None:
            return _CallObject(ParsedCall(name, arguments, False), None)
        j = value_end


def _is_json_object(raw: str) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


_SCALAR = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?|true|false|null")


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]``, or None while it is incomplete."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _value_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    match = _SCALAR.match(text, i)
    if match is None or match.end() == len(text):  # a number may go on
        return None
    return match.end()


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (not yet content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
