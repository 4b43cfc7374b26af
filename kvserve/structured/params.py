"""What a request's output must match (vLLM's ``GuidedDecodingParams``), checked on construction.

Exactly one kind is set. Each is turned into an xgrammar ``Grammar`` right away, so a bad JSON schema,
regex or grammar is a ValueError naming it before the request reaches the engine; the grammar is compiled
against the tokenizer later (``structured/grammars.py``), where compiled grammars are cached by ``key``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.platform.extras import extra_imports

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# xgrammar prefixes its errors with "[time] file.cc:line: "; the user needs only the rest.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .* is false: )?")


@dataclass(frozen=True)
class GuidedDecodingParams:
    """``json``: a JSON schema (dict or JSON text); ``regex``: a regular expression the whole output matches;
    ``choice``: the output is exactly one of these strings; ``grammar``: an EBNF grammar (xgrammar's, GBNF
    style, with a ``root`` rule); ``json_object``: any JSON object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"guided decoding takes exactly one of {', '.join(KINDS)}; got {kinds or 'none'}")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        self.to_grammar()  # raises for a bad schema, regex or grammar

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the constraint (equal keys compile to the same grammar)."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value)  # property order is output order
        return self.kind, text

    def to_grammar(self) -> xgrammar.Grammar:
        kind, text = self.key
        try:
            return _grammar(kind, text, self.choice)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _NATIVE_PREFIX.sub("", str(exc).strip()).splitlines()[0]
            raise ValueError(f"{kind} is not a valid {_WHAT[kind]}: {message}") from None


_WHAT = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar", "choice": "choice list"}


def _grammar(kind: str, text: str, choice: tuple[str, ...] | None) -> xgrammar.Grammar:
    with extra_imports("structured", "guided decoding"):
        import xgrammar

    if kind == "json":
        # Compact JSON (no free whitespace): a small model may otherwise emit newlines until max_tokens.
        return xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return xgrammar.Grammar.from_regex(text)
    if kind == "grammar":
        return xgrammar.Grammar.from_ebnf(text)
    if kind == "choice":  # JSON string literals are valid EBNF string literals
        return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice))
    # json_object: OpenAI's "any JSON object" (xgrammar's built-in JSON grammar also allows arrays and scalars).
    return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
