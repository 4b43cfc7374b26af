"""PML, Prompt Cache's prompt markup (Gim et al., MLSys'24, https://arxiv.org/abs/2311.04934): parse, check, print.

A *schema* declares reusable prompt modules; a *prompt* imports some of them by tag name and adds new
text. Only structure lives here (no tokenizer, no positions: see ``schema.py``)::

    <schema name="travel">
      <system>You are a travel agent.</system>
      <module name="trip-plan">Plan a trip of <param name="duration" len="4"/> to
        <union><module name="paris">Paris.</module><module name="rome">Rome.</module></union>
      </module>
    </schema>

    <prompt schema="travel"><trip-plan duration="3 days"><rome/></trip-plan>
      <user>Where should I eat?</user></prompt>

Text outside every module belongs to the schema itself (an anonymous module that every prompt
includes). ``<system>``, ``<user>`` and ``<assistant>`` wrap text in the model's chat template.

Whitespace: XML indentation is formatting, not prompt text. A text run between tags that spans lines
is cleaned: dropped if it is only whitespace, else its leading blank lines and its trailing line break
(with the whitespace around it) are removed and the rest is dedented, except a first line that goes on
from a tag. A run within one line is kept as written, so ``of <param/> to`` keeps both spaces, also
with a line break after ``to``. ``xml:space="preserve"`` on an element keeps every
character of the text inside it (XML's own switch); ``to_pml`` prints that way.
"""

from __future__ import annotations

import re
import textwrap
import xml.parsers.expat
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from kvserve.errors import KVServeError

ROLES = ("system", "user", "assistant")
_RESERVED = frozenset({"schema", "prompt", "module", "param", "union", *ROLES})
_SPACE = "xml:space"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")  # an XML name without ':' (imports use it as a tag)
_MAX_DEPTH = 100  # element nesting: the tree is walked recursively, and deeper could overflow Python's stack


class PMLError(KVServeError, ValueError):
    """Bad PML: the message names the problem and, where one is known, the line."""

    def __init__(self, message: str, line: int | None = None) -> None:
        self.line = line
        super().__init__(f"line {line}: {message}" if line else message)


@dataclass(frozen=True)
class Text:
    text: str
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Param:
    """``len`` positions a prompt fills with an argument of at most ``length`` tokens."""

    name: str
    length: int
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Role:
    role: str  # system | user | assistant
    children: tuple = ()
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Module:
    name: str
    children: tuple = ()  # Text | Param | Role | Module | Union
    line: int = field(default=0, compare=False)

    def params(self) -> dict[str, Param]:
        """This module's own parameters (not those of modules nested in it)."""
        return {p.name: p for p in _own_nodes(self.children) if isinstance(p, Param)}

    def submodules(self) -> dict[str, Module]:
        """Modules nested directly in this one (union members included)."""
        return {m.name: m for m in _own_nodes(self.children) if isinstance(m, Module)}


@dataclass(frozen=True)
class Union:
    """Mutually exclusive modules: a prompt imports at most one; they share a start position."""

    members: tuple[Module, ...]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Schema:
    name: str
    children: tuple = ()
    line: int = field(default=0, compare=False)

    def root(self) -> Module:
        """The schema as its anonymous root module: its own text is in every prompt."""
        return Module("", self.children, self.line)

    def modules(self) -> dict[str, Module]:
        """Every named module, nested ones included."""
        found: dict[str, Module] = {}
        stack = [self.root()]
        while stack:
            for module in stack.pop().submodules().values():
                found[module.name] = module
                stack.append(module)
        return found


@dataclass(frozen=True)
class Import:
    """A prompt's ``<module-name arg="value">``: arguments by parameter, nested imports, new text."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    children: tuple = ()  # Import | Text
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Prompt:
    schema: str
    children: tuple = ()  # Text | Role | Import
    line: int = field(default=0, compare=False)


# ----- parsing -----


@dataclass
class _Element:
    tag: str
    attrs: dict[str, str]
    line: int
    preserve: bool = False  # xml:space="preserve" here or on an ancestor: text is kept as written
    children: list = field(default_factory=list)  # _Element | Text


def _parse_xml(text: str) -> _Element:
    if not isinstance(text, str):
        raise PMLError(f"PML must be a string, got {type(text).__name__}")
    parser = xml.parsers.expat.ParserCreate()
    root = _Element("", {}, 0)
    stack = [root]
    run: list = []  # character data since the last tag: [line, chunk, chunk, ...], joined once (per chunk is quadratic)

    def flush() -> None:
        if run:
            stack[-1].children.append(Text("".join(run[1:]), run[0]))
            run.clear()

    def start(tag: str, attrs: dict[str, str]) -> None:
        flush()
        line = parser.CurrentLineNumber
        if len(stack) > _MAX_DEPTH:
            raise PMLError(f"elements are nested more than {_MAX_DEPTH} deep", line)
        space = attrs.pop(_SPACE, None)
        if space not in (None, "preserve", "default"):
            raise PMLError(f'{_SPACE} must be "preserve" or "default", got {space!r}', line)
        preserve = stack[-1].preserve if space is None else space == "preserve"
        element = _Element(tag, attrs, line, preserve)
        stack[-1].children.append(element)
        stack.append(element)

    def end(_tag: str) -> None:
        flush()
        stack.pop()

    def data(chunk: str) -> None:
        if not run:
            run.append(parser.CurrentLineNumber)
        run.append(chunk)

    parser.StartElementHandler, parser.EndElementHandler, parser.CharacterDataHandler = start, end, data
    try:
        parser.Parse(text, True)
    except PMLError:
        raise
    except xml.parsers.expat.ExpatError as error:
        raise PMLError(f"malformed XML: {xml.parsers.expat.ErrorString(error.code)}", error.lineno) from None
    except UnicodeEncodeError as error:  # a lone surrogate (JSON can carry one): expat reads UTF-8, which has none
        line = text.count("\n", 0, error.start) + 1
        raise PMLError(f"character {text[error.start]!r} is not valid Unicode", line) from None
    (element,) = [c for c in root.children if isinstance(c, _Element)]  # expat allows one root only
    return element


def _clean(text: str, preserve: bool) -> str:
    """Drop XML formatting around a text run (see the module docstring)."""
    if preserve or "\n" not in text:  # inline text: every space in it is meant
        return text
    if not text.strip():
        return ""
    text = re.sub(r"\n\s*\Z", "", text)
    blank = re.match(r"[ \t]*\n(?:[ \t]*\n)*", text)
    if blank:  # the run starts on a line of its own: all of it is indented
        return textwrap.dedent(text[blank.end() :])
    first, newline, rest = text.partition("\n")  # the first line goes on from a tag: its spaces are inline
    return first + newline + textwrap.dedent(rest)


def _attrs(element: _Element, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, str]:
    unknown = sorted(set(element.attrs) - set(required) - set(optional))
    if unknown:
        raise PMLError(f"<{element.tag}> has unknown attribute(s) {unknown}", element.line)
    missing = [name for name in required if name not in element.attrs]
    if missing:
        raise PMLError(f"<{element.tag}> needs the attribute {missing[0]!r}", element.line)
    return element.attrs


def _check_name(name: str, what: str, line: int) -> str:
    if not _NAME.match(name) or name in _RESERVED:
        raise PMLError(
            f"{what} name {name!r} must be an XML name (letters, digits, '_', '-', '.'; not starting with a digit) "
            f"and not one of {sorted(_RESERVED)}",
            line,
        )
    return name


def parse_schema(text: str) -> Schema:
    """Parse and check a ``<schema name=...>`` document; raises ``PMLError``."""
    element = _parse_xml(text)
    if element.tag != "schema":
        raise PMLError(f"a schema's root must be <schema name=...>, got <{element.tag}>", element.line)
    name = _attrs(element, ("name",))["name"]
    if not name.strip():
        raise PMLError("<schema> needs a non-empty name", element.line)
    schema = Schema(name, _schema_children(element, in_module=False, in_role=False), element.line)
    _check_unique_modules(schema.root(), {})
    return schema


def _schema_children(element: _Element, in_module: bool, in_role: bool) -> tuple:
    nodes: list = []
    for child in element.children:
        if isinstance(child, Text):
            if cleaned := _clean(child.text, element.preserve):
                nodes.append(Text(cleaned, child.line))
        else:
            nodes.append(_schema_node(child, in_module, in_role))
    return tuple(nodes)


def _schema_node(element: _Element, in_module: bool, in_role: bool) -> object:
    tag, line = element.tag, element.line
    if tag == "module":
        name = _check_name(_attrs(element, ("name",))["name"], "module", line)
        return Module(name, _schema_children(element, in_module=True, in_role=in_role), line)
    if tag == "param":
        attrs = _attrs(element, ("name", "len"))
        if not in_module:
            raise PMLError(f"<param name={attrs['name']!r}> must be inside a <module>", line)
        if element.children:
            raise PMLError(f"<param name={attrs['name']!r}> must be empty (<param name=... len=.../>)", line)
        if not re.fullmatch(r"\s*[0-9]+\s*", attrs["len"]) or int(attrs["len"]) < 1:
            raise PMLError(f"<param name={attrs['name']!r}> needs len = a whole number of tokens >= 1, "
                           f"got {attrs['len']!r}", line)  # fmt: skip
        return Param(_check_name(attrs["name"], "parameter", line), int(attrs["len"]), line)
    if tag == "union":
        _attrs(element, ())
        members = []
        for child in element.children:
            if isinstance(child, Text):
                if child.text.strip():
                    line = child.line + child.text[: len(child.text) - len(child.text.lstrip())].count("\n")
                    raise PMLError(f"<union> holds only <module>s, found text {child.text.strip()[:30]!r}", line)
            elif child.tag != "module":
                raise PMLError(f"<union> holds only <module>s, found <{child.tag}>", child.line)
            else:
                members.append(_schema_node(child, in_module, in_role))
        if not members:
            raise PMLError("<union> needs at least one <module>", line)
        return Union(tuple(members), line)
    if tag in ROLES:
        _attrs(element, ())
        if in_role:
            raise PMLError(f"<{tag}> cannot be inside another role tag", line)
        return Role(tag, _schema_children(element, in_module, in_role=True), line)
    raise PMLError(
        f"unknown tag <{tag}> in a schema; expected one of <module>, <param>, <union>, <system>, <user>, <assistant>",
        line,
    )


def _check_unique_modules(module: Module, seen: dict[str, int]) -> None:
    params: set[str] = set()
    for node in _own_nodes(module.children):
        if isinstance(node, Param):
            if node.name in params:
                raise PMLError(f"module {module.name or '(schema)'!r} has two parameters named {node.name!r}",
                               node.line)  # fmt: skip
            params.add(node.name)
        elif isinstance(node, Module):
            if node.name in seen:
                raise PMLError(f"duplicate module name {node.name!r} (first declared on line {seen[node.name]})",
                               node.line)  # fmt: skip
            seen[node.name] = node.line
            _check_unique_modules(node, seen)


def _own_nodes(children: tuple) -> list:
    """A module's own nodes in order: role tags are looked through, union members listed, nested modules not entered."""
    nodes = []
    for node in children:
        if isinstance(node, Role):
            nodes += _own_nodes(node.children)
        elif isinstance(node, Union):
            nodes += node.members
        else:
            nodes.append(node)
    return nodes


def parse_prompt(text: str) -> Prompt:
    """Parse a ``<prompt schema=...>`` document (structure only; ``check_prompt`` checks it against its schema)."""
    element = _parse_xml(text)
    if element.tag != "prompt":
        raise PMLError(f"a prompt's root must be <prompt schema=...>, got <{element.tag}>", element.line)
    schema = _attrs(element, ("schema",))["schema"]
    return Prompt(schema, _prompt_children(element, in_role=False, in_import=False), element.line)


def _prompt_children(element: _Element, in_role: bool, in_import: bool) -> tuple:
    nodes: list = []
    for child in element.children:
        if isinstance(child, Text):
            if cleaned := _clean(child.text, element.preserve):
                nodes.append(Text(cleaned, child.line))
        elif child.tag in ROLES:
            _attrs(child, ())
            if in_role or in_import:
                raise PMLError(f"<{child.tag}> cannot be inside {'a role tag' if in_role else 'an import'}",
                               child.line)  # fmt: skip
            nodes.append(Role(child.tag, _prompt_children(child, in_role=True, in_import=False), child.line))
        elif child.tag in _RESERVED:
            raise PMLError(f"<{child.tag}> belongs in a schema, not in a prompt", child.line)
        else:
            _check_name(child.tag, "module", child.line)
            args = tuple(child.attrs.items())
            nodes.append(Import(child.tag, args, _prompt_children(child, in_role=False, in_import=True), child.line))
    return tuple(nodes)


_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def pml_escape(text: str) -> str:
    """``text`` as PML character data that parses back to exactly ``text`` under ``xml:space="preserve"``."""
    bad = _NOT_XML.search(text)
    if bad:
        raise PMLError(f"character {bad.group()!r} at offset {bad.start()} cannot appear in XML, so not in PML")
    return escape(text, {"\r": "&#13;"})


def is_pml_prompt(text: object) -> bool:
    """Whether a prompt string is PML (starts with ``<prompt``) rather than plain text."""
    return isinstance(text, str) and re.match(r"\s*<prompt[\s>/]", text) is not None


# ----- checking a prompt against its schema -----


def check_prompt(prompt: Prompt, schema: Schema) -> None:
    """Raise ``PMLError`` for an import the schema does not allow (the tokenizer-free checks)."""
    if prompt.schema != schema.name:
        raise PMLError(f"the prompt is for schema {prompt.schema!r}, not {schema.name!r}", prompt.line)
    _check_imports(_imports(prompt.children), schema.root(), set())


def _imports(children: tuple) -> list[Import]:
    found = []
    for node in children:
        if isinstance(node, Import):
            found.append(node)
        elif isinstance(node, Role):
            found += _imports(node.children)
    return found


def _check_imports(imports: list[Import], parent: Module, imported: set[str]) -> None:
    allowed = parent.submodules()
    unions = {member.name: node for node in _unions_in(parent.children) for member in node.members}
    chosen: dict[int, str] = {}
    for imp in imports:
        module = allowed.get(imp.name)
        if module is None:
            where = f"module {parent.name!r}" if parent.name else "the top level of the schema"
            raise PMLError(f"no module {imp.name!r} at {where}; it has {sorted(allowed) or 'none'}", imp.line)
        if imp.name in imported:
            raise PMLError(f"module {imp.name!r} is imported twice", imp.line)
        imported.add(imp.name)
        union = unions.get(imp.name)
        if union is not None:
            if id(union) in chosen:
                raise PMLError(f"modules {chosen[id(union)]!r} and {imp.name!r} are members of one <union>; "
                               "import at most one", imp.line)  # fmt: skip
            chosen[id(union)] = imp.name
        _check_args(imp, module)
        _check_imports(_imports(imp.children), module, imported)


def _unions_in(children: tuple) -> list[Union]:
    """A module's own unions (role tags looked through, nested modules not entered)."""
    unions = []
    for node in children:
        if isinstance(node, Role):
            unions += _unions_in(node.children)
        elif isinstance(node, Union):
            unions.append(node)
    return unions


def _check_args(imp: Import, module: Module) -> None:
    params = module.params()
    given = dict(imp.args)
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise PMLError(f"module {imp.name!r} has no parameter {unknown[0]!r}; it has {sorted(params) or 'none'}",
                       imp.line)  # fmt: skip
    missing = sorted(set(params) - set(given))
    if missing:
        raise PMLError(f"module {imp.name!r} needs an argument for parameter {missing[0]!r}", imp.line)


# ----- printing -----


def to_pml(document: Schema | Prompt) -> str:
    """PML text that parses back to an equal ``document``."""
    preserve = f'{_SPACE}="preserve"'  # the texts are printed exactly as they are
    if isinstance(document, Schema):
        return f"<schema name={quoteattr(document.name)} {preserve}>{_print(document.children)}</schema>"
    return f"<prompt schema={quoteattr(document.schema)} {preserve}>{_print(document.children)}</prompt>"


def _print(nodes: tuple) -> str:
    return "".join(_print_node(node) for node in nodes)


def _print_node(node: object) -> str:
    if isinstance(node, Text):
        return pml_escape(node.text)
    if isinstance(node, Param):
        return f'<param name={quoteattr(node.name)} len="{node.length}"/>'
    if isinstance(node, Role):
        return f"<{node.role}>{_print(node.children)}</{node.role}>"
    if isinstance(node, Module):
        return f"<module name={quoteattr(node.name)}>{_print(node.children)}</module>"
    if isinstance(node, Union):
        return f"<union>{_print(node.members)}</union>"
    if isinstance(node, Import):
        args = "".join(f" {name}={quoteattr(value)}" for name, value in node.args)
        return f"<{node.name}{args}>{_print(node.children)}</{node.name}>"
    raise TypeError(f"not a PML node: {node!r}")
