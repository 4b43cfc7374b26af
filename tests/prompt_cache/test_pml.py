"""The PML parser (kvserve.prompt_cache.pml): the AST a document parses to, the whitespace rules, printing back
(to_pml), every error with its line, check_prompt's import checks, and property tests: arbitrary text only ever
raises PMLError, and generated documents survive a print/parse round trip."""

from __future__ import annotations

import operator
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.prompt_cache.pml import (
    Import,
    Module,
    Param,
    PMLError,
    Prompt,
    Role,
    Schema,
    Text,
    Union,
    check_prompt,
    is_pml_prompt,
    parse_prompt,
    parse_schema,
    to_pml,
)

TRAVEL = """\
<schema name="travel">
  <system>You are a travel agent.</system>
  Answer in one paragraph.
  <module name="trip-plan">
    Plan a trip of <param name="duration" len="4"/> to
    <union>
      <module name="paris">Paris.</module>
      <module name="rome">Rome, <module name="vatican">with the Vatican</module>.</module>
    </union>
  </module>
  <user>Budget: <module name="budget"><param name="amount" len="2"/> <param name="currency" len="1"/></module>.</user>
  <assistant>Noted.</assistant>
</schema>
"""

TRAVEL_AST = Schema(
    "travel",
    (
        Role("system", (Text("You are a travel agent."),)),
        Text("Answer in one paragraph."),
        Module(
            "trip-plan",
            (
                Text("Plan a trip of "),
                Param("duration", 4),
                Text(" to"),
                Union(
                    (
                        Module("paris", (Text("Paris."),)),
                        Module("rome", (Text("Rome, "), Module("vatican", (Text("with the Vatican"),)), Text("."))),
                    )
                ),
            ),
        ),
        Role(
            "user",
            (
                Text("Budget: "),
                Module("budget", (Param("amount", 2), Text(" "), Param("currency", 1))),
                Text("."),
            ),
        ),
        Role("assistant", (Text("Noted."),)),
    ),
)

TRIP = """\
<prompt schema="travel">
  <trip-plan duration="3 days">
    <rome><vatican/></rome>
    Extra words.
  </trip-plan>
  <user>Where should I eat? <budget amount="50" currency="EUR"/></user>
</prompt>
"""

TRIP_AST = Prompt(
    "travel",
    (
        Import(
            "trip-plan", (("duration", "3 days"),), (Import("rome", (), (Import("vatican"),)), Text("Extra words."))
        ),
        Role("user", (Text("Where should I eat? "), Import("budget", (("amount", "50"), ("currency", "EUR"))))),
    ),
)


# ----- parsing a representative schema and prompt -----


def test_schema_parses_to_the_expected_ast():
    assert parse_schema(TRAVEL) == TRAVEL_AST


def test_schema_nodes_carry_their_lines():
    schema = parse_schema(TRAVEL)
    modules = schema.modules()
    assert (schema.line, modules["trip-plan"].line, modules["vatican"].line, modules["budget"].line) == (1, 4, 8, 11)
    assert modules["trip-plan"].params()["duration"].line == 5


def test_schema_modules_lists_nested_ones():
    modules = parse_schema(TRAVEL).modules()
    assert sorted(modules) == ["budget", "paris", "rome", "trip-plan", "vatican"]
    assert modules["vatican"] == Module("vatican", (Text("with the Vatican"),))


def test_module_params_and_submodules_are_its_own():
    schema = parse_schema(TRAVEL)
    modules = schema.modules()
    assert sorted(schema.root().submodules()) == ["budget", "trip-plan"]  # through <user>, not into modules
    assert sorted(modules["trip-plan"].submodules()) == ["paris", "rome"]  # union members, not vatican
    assert modules["trip-plan"].params() == {"duration": Param("duration", 4)}
    assert modules["budget"].params() == {"amount": Param("amount", 2), "currency": Param("currency", 1)}
    assert modules["rome"].params() == {}
    assert modules["paris"].submodules() == {}


def test_params_inside_a_role_inside_a_module_are_the_modules():
    schema = parse_schema('<schema name="s"><module name="m"><user><param name="p" len="3"/></user></module></schema>')
    assert schema.modules()["m"].params() == {"p": Param("p", 3)}


def test_prompt_parses_to_the_expected_ast():
    assert parse_prompt(TRIP) == TRIP_AST


def test_valid_prompt_passes_check():
    assert check_prompt(parse_prompt(TRIP), parse_schema(TRAVEL)) is None


# ----- whitespace rules -----


def _module_text(body: str) -> tuple:
    return parse_schema(f'<schema name="s"><module name="m">{body}</module></schema>').modules()["m"].children


def test_indentation_is_dropped():
    assert _module_text("\n    Hello\n      world\n  ") == (Text("Hello\n  world"),)


def test_whitespace_only_multi_line_run_is_dropped():
    body = '<param name="a" len="1"/>\n  <param name="b" len="1"/>'
    assert _module_text(body) == (Param("a", 1), Param("b", 1))


def test_inline_spaces_around_a_param_are_kept():
    assert _module_text('of <param name="p" len="1"/> to') == (Text("of "), Param("p", 1), Text(" to"))


def test_inline_space_before_a_line_break_is_kept():
    body = '\n  of <param name="p" len="1"/> to\n    <module name="n">x</module>\n'
    assert _module_text(body)[:3] == (Text("of "), Param("p", 1), Text(" to"))


def test_lines_after_an_inline_first_line_are_dedented():
    assert _module_text("Steps: \n    one\n      two\n  ") == (Text("Steps: \none\n  two"),)


def test_lone_space_between_two_params_is_kept():
    body = '<param name="a" len="1"/> <param name="b" len="1"/>'
    assert _module_text(body) == (Param("a", 1), Text(" "), Param("b", 1))


def test_xml_space_preserve_keeps_every_character():
    schema = parse_schema('<schema name="s">\n  <module name="m" xml:space="preserve">\n  x\n</module>\n</schema>')
    assert schema.modules()["m"].children == (Text("\n  x\n"),)


def test_xml_space_default_inside_preserve_cleans_again():
    text = '<schema name="s" xml:space="preserve"><module name="m" xml:space="default">\n  x\n</module></schema>'
    assert parse_schema(text).modules()["m"].children == (Text("x"),)


def test_text_around_a_comment_is_one_run():
    assert _module_text("a<!-- note -->b") == (Text("ab"),)


def test_a_text_run_in_many_expat_chunks_is_one_text():
    """expat hands a long text run over in many chunks (about one a line); they make one Text, joined once
    (joining them pairwise was quadratic: 80,000 lines took over 10 s, now about 0.1 s)."""
    lines = 80_000
    text = '<schema name="s"><module name="m">' + "a line of prompt text\n" * lines + "</module></schema>"
    (body,) = parse_schema(text).modules()["m"].children
    assert body.text.count("\n") == lines - 1


# ----- printing: to_pml parses back equal -----

ESCAPED_SCHEMA = """\
<schema name="a &amp; &quot;b&quot; &lt;c&gt; 'd'">
  <module name="m">Tom &amp; Jerry &lt;3 "quotes" 'apostrophes' ]]&gt; tab&#9;and cr&#13;</module>
</schema>
"""

ESCAPED_PROMPT = """\
<prompt schema="a &amp; b">
  <m p="say &quot;hi&quot; &amp; 'bye' &lt;now&gt;&#10;then" q=''>a &lt; b &amp;&amp; c &gt; d</m>
</prompt>
"""

WHITESPACE_SCHEMA = """\
<schema name="ws">
  <module name="m">
    of <param name="a" len="1"/> <param name="b" len="2"/> to
      indented
  </module>
  <module name="n" xml:space="preserve">  kept
    as is  </module>
</schema>
"""


@pytest.mark.parametrize("text", [TRAVEL, ESCAPED_SCHEMA, WHITESPACE_SCHEMA], ids=["travel", "escaped", "whitespace"])
def test_schema_round_trips(text):
    schema = parse_schema(text)
    assert parse_schema(to_pml(schema)) == schema


@pytest.mark.parametrize("text", [TRIP, ESCAPED_PROMPT], ids=["trip", "escaped"])
def test_prompt_round_trips(text):
    prompt = parse_prompt(text)
    assert parse_prompt(to_pml(prompt)) == prompt


def test_escaped_text_and_attributes_parse_to_their_characters():
    schema = parse_schema(ESCAPED_SCHEMA)
    assert schema.name == "a & \"b\" <c> 'd'"
    assert schema.modules()["m"].children == (Text("Tom & Jerry <3 \"quotes\" 'apostrophes' ]]> tab\tand cr\r"),)
    (imp,) = parse_prompt(ESCAPED_PROMPT).children
    assert imp == Import("m", (("p", "say \"hi\" & 'bye' <now>\nthen"), ("q", "")), (Text("a < b && c > d"),))


def test_printed_whitespace_is_preserved_exactly():
    schema = Schema("s", (Module("m", (Text("\n  lead and trail  \n"), Param("p", 1), Text(" "))),))
    assert parse_schema(to_pml(schema)) == schema


def test_to_pml_rejects_text_xml_cannot_hold():
    with pytest.raises(PMLError, match="cannot appear in XML"):
        to_pml(Schema("s", (Text("bell\x07"),)))


# ----- errors: each names the problem and its line -----


def _deep_schema(depth: int) -> str:
    """A schema element with modules nested inside it to ``depth`` elements in all, one per line."""
    opens = "".join(f'<module name="m{i}">\n' for i in range(depth - 1))
    return f'<schema name="s">\n{opens}{"</module>" * (depth - 1)}</schema>'


SCHEMA_ERRORS = [
    ("unclosed-tag", '<schema name="s">\n<module name="a">\ntext\n', "malformed XML: no element found", 4),
    ("mismatched-tag", '<schema name="s">\n<module name="a">\n</schema>', "malformed XML: mismatched tag", 3),
    ("two-roots", '<schema name="s"/>\n<schema name="t"/>', "malformed XML: junk after document element", 2),
    ("empty-string", "", "malformed XML: no element found", 1),
    ("garbage", "\n\nnot xml at all", "malformed XML: syntax error", 3),
    ("bare-ampersand", '<schema name="s">\n a & b</schema>', "malformed XML: not well-formed (invalid token)", 2),
    ("wrong-root", '\n<prompt schema="s"/>', "a schema's root must be <schema name=...>, got <prompt>", 2),
    ("no-schema-name", "\n<schema>\n</schema>", "<schema> needs the attribute 'name'", 2),
    ("blank-schema-name", '\n<schema name="  ">\n</schema>', "<schema> needs a non-empty name", 2),
    ("unknown-tag", '<schema name="s">\n  <foo/>\n</schema>', "unknown tag <foo> in a schema", 2),
    (
        "module-without-name",
        '<schema name="s">\n\n  <module>x</module>\n</schema>',
        "<module> needs the attribute 'name'",
        3,
    ),
    ("module-name-reserved", '<schema name="s">\n<module name="param"/>\n</schema>', "module name 'param' must be", 2),
    ("module-name-role", '<schema name="s">\n<module name="user"/>\n</schema>', "module name 'user' must be", 2),
    ("module-name-digit", '<schema name="s">\n<module name="1st"/>\n</schema>', "module name '1st' must be", 2),
    ("module-name-colon", '<schema name="s">\n<module name="a:b"/>\n</schema>', "module name 'a:b' must be", 2),
    (
        "duplicate-module",
        '<schema name="s">\n<module name="a"/>\n<module name="a"/>\n</schema>',
        "duplicate module name 'a' (first declared on line 2)",
        3,
    ),
    (
        "duplicate-nested-module",
        '<schema name="s">\n<module name="a">\n<module name="b">\n<module name="a"/>\n</module>\n</module>\n</schema>',
        "duplicate module name 'a' (first declared on line 2)",
        4,
    ),
    (
        "duplicate-union-members",
        '<schema name="s">\n<union>\n<module name="a"/>\n<module name="a"/>\n</union>\n</schema>',
        "duplicate module name 'a' (first declared on line 3)",
        4,
    ),
    (
        "duplicate-across-unions",
        '<schema name="s">\n<union><module name="a"/></union>\n<union>\n<module name="b"><module name="a"/></module>'
        "</union>\n</schema>",
        "duplicate module name 'a' (first declared on line 2)",
        4,
    ),
    (
        "param-outside-module",
        '<schema name="s">\n  <param name="p" len="1"/>\n</schema>',
        "<param name='p'> must be inside a <module>",
        2,
    ),
    (
        "param-in-top-level-role",
        '<schema name="s">\n<user>\n<param name="p" len="1"/></user>\n</schema>',
        "<param name='p'> must be inside a <module>",
        3,
    ),
    (
        "param-without-len",
        '<schema name="s">\n<module name="m">\n<param name="p"/>\n</module>\n</schema>',
        "<param> needs the attribute 'len'",
        3,
    ),
    (
        "param-without-name",
        '<schema name="s">\n<module name="m">\n<param len="2"/>\n</module>\n</schema>',
        "<param> needs the attribute 'name'",
        3,
    ),
    (
        "param-len-zero",
        '<schema name="s">\n<module name="m">\n<param name="p" len="0"/>\n</module>\n</schema>',
        "<param name='p'> needs len = a whole number of tokens >= 1, got '0'",
        3,
    ),
    (
        "param-len-abc",
        '<schema name="s">\n<module name="m">\n<param name="p" len="abc"/>\n</module>\n</schema>',
        "<param name='p'> needs len = a whole number of tokens >= 1, got 'abc'",
        3,
    ),
    (
        "param-len-negative",
        '<schema name="s">\n<module name="m">\n<param name="p" len="-3"/>\n</module>\n</schema>',
        "got '-3'",
        3,
    ),
    (
        "param-with-children",
        '<schema name="s">\n<module name="m">\n<param name="p" len="2">x</param>\n</module>\n</schema>',
        "<param name='p'> must be empty",
        3,
    ),
    (
        "param-bad-name",
        '<schema name="s">\n<module name="m">\n<param name="9p" len="2"/>\n</module>\n</schema>',
        "parameter name '9p' must be",
        3,
    ),
    (
        "duplicate-param",
        '<schema name="s">\n<module name="m">\n<param name="p" len="1"/>\n<user><param name="p" len="2"/></user>\n'
        "</module>\n</schema>",
        "module 'm' has two parameters named 'p'",
        4,
    ),
    (
        "union-with-text",
        '<schema name="s">\n<union>\n  oops\n  <module name="a"/>\n</union>\n</schema>',
        "<union> holds only <module>s, found text 'oops'",
        3,
    ),
    (
        "union-with-role",
        '<schema name="s">\n<union>\n<module name="a"/>\n<user>hi</user>\n</union>\n</schema>',
        "<union> holds only <module>s, found <user>",
        4,
    ),
    (
        "union-with-param",
        '<schema name="s">\n<module name="m"><union>\n<param name="p" len="1"/>\n</union></module>\n</schema>',
        "<union> holds only <module>s, found <param>",
        3,
    ),
    (
        "empty-union",
        '<schema name="s">\n<module name="m">\n<union>\n</union>\n</module>\n</schema>',
        "<union> needs at least one <module>",
        3,
    ),
    (
        "role-in-role",
        '<schema name="s">\n<system>\n<user>hi</user>\n</system>\n</schema>',
        "<user> cannot be inside another role tag",
        3,
    ),
    (
        "role-in-module-in-role",
        '<schema name="s">\n<user><module name="m">\n<assistant>hi</assistant>\n</module></user>\n</schema>',
        "<assistant> cannot be inside another role tag",
        3,
    ),
    (
        "unknown-attribute-module",
        '<schema name="s">\n<module name="m" color="red"/>\n</schema>',
        "<module> has unknown attribute(s) ['color']",
        2,
    ),
    (
        "unknown-attribute-schema",
        '\n<schema name="s" version="2"/>',
        "<schema> has unknown attribute(s) ['version']",
        2,
    ),
    (
        "unknown-attribute-param",
        '<schema name="s">\n<module name="m">\n<param name="p" len="1" max="3"/>\n</module>\n</schema>',
        "<param> has unknown attribute(s) ['max']",
        3,
    ),
    (
        "unknown-attribute-union",
        '<schema name="s">\n<union id="u"/>\n</schema>',
        "<union> has unknown attribute(s) ['id']",
        2,
    ),
    (
        "unknown-attribute-role",
        '<schema name="s">\n<user lang="en"/>\n</schema>',
        "<user> has unknown attribute(s) ['lang']",
        2,
    ),
    (
        "bad-xml-space",
        '<schema name="s">\n<module name="m" xml:space="keep"/>\n</schema>',
        'xml:space must be "preserve" or "default", got \'keep\'',
        2,
    ),
    ("nested-too-deep", _deep_schema(101), "elements are nested more than 100 deep", 101),
    ("lone-surrogate", '<schema name="s">\n<module name="m">\ud800</module>\n</schema>', "is not valid Unicode", 2),
]

PROMPT_ERRORS = [
    ("mismatched-tag", '<prompt schema="s">\n<a>\n</b>\n</prompt>', "malformed XML: mismatched tag", 3),
    ("empty-string", "", "malformed XML: no element found", 1),
    ("wrong-root", '\n<schema name="s"/>', "a prompt's root must be <prompt schema=...>, got <schema>", 2),
    ("no-schema-attribute", "\n<prompt>\nhi</prompt>", "<prompt> needs the attribute 'schema'", 2),
    ("unknown-attribute", '\n<prompt schema="s" name="x"/>', "<prompt> has unknown attribute(s) ['name']", 2),
    (
        "schema-tag",
        '<prompt schema="s">\n<schema name="s"/>\n</prompt>',
        "<schema> belongs in a schema, not in a prompt",
        2,
    ),
    ("prompt-tag", '<prompt schema="s">\n<prompt schema="s"/>\n</prompt>', "<prompt> belongs in a schema", 2),
    ("module-tag", '<prompt schema="s">\n\n<module name="m"/>\n</prompt>', "<module> belongs in a schema", 3),
    ("param-tag", '<prompt schema="s">\n<a><param name="p" len="1"/></a>\n</prompt>', "<param> belongs in a schema", 2),
    ("union-tag", '<prompt schema="s">\n<union/>\n</prompt>', "<union> belongs in a schema", 2),
    (
        "role-in-role",
        '<prompt schema="s">\n<user>\n<system>x</system></user>\n</prompt>',
        "<system> cannot be inside a role tag",
        3,
    ),
    (
        "role-in-import",
        '<prompt schema="s">\n<a>\n<user>x</user></a>\n</prompt>',
        "<user> cannot be inside an import",
        3,
    ),
    (
        "role-attribute",
        '<prompt schema="s">\n<user lang="en">x</user>\n</prompt>',
        "<user> has unknown attribute(s)",
        2,
    ),
    ("import-name-colon", '<prompt schema="s">\n<a:b/>\n</prompt>', "module name 'a:b' must be", 2),
    ("bad-xml-space", '<prompt schema="s">\n<a xml:space="yes"/>\n</prompt>', 'xml:space must be "preserve"', 2),
]

CHECK_ERRORS = [
    ("unknown-module", "<tokyo/>", "no module 'tokyo' at the top level of the schema", 2),
    (
        "nested-at-top-level",
        '<trip-plan duration="x"/>\n<paris/>',
        "no module 'paris' at the top level of the schema",
        3,
    ),
    (
        "nested-skipping-its-parent",
        '<trip-plan duration="x">\n<vatican/>\n</trip-plan>',
        "no module 'vatican' at module 'trip-plan'",
        3,
    ),
    (
        "two-union-members",
        '<trip-plan duration="x">\n<paris/>\n<rome/>\n</trip-plan>',
        "modules 'paris' and 'rome' are members of one <union>",
        4,
    ),
    (
        "imported-twice",
        '<budget amount="1" currency="EUR"/>\n<user><budget amount="2" currency="EUR"/></user>',
        "module 'budget' is imported twice",
        3,
    ),
    ("missing-argument", '\n<budget amount="1"/>', "module 'budget' needs an argument for parameter 'currency'", 3),
    ("unknown-parameter", '<budget amount="1" currency="EUR" tip="5"/>', "module 'budget' has no parameter 'tip'", 2),
    (
        "argument-to-paramless-module",
        '<trip-plan duration="x"><paris when="now"/></trip-plan>',
        "no parameter 'when'",
        2,
    ),
]


def _raises_at(line: int, message: str):
    return pytest.raises(PMLError, match=rf"\Aline {line}: .*{re.escape(message)}")


@pytest.mark.parametrize(("text", "message", "line"), [e[1:] for e in SCHEMA_ERRORS], ids=[e[0] for e in SCHEMA_ERRORS])
def test_schema_error(text, message, line):
    with _raises_at(line, message) as info:
        parse_schema(text)
    assert info.value.line == line


@pytest.mark.parametrize(("text", "message", "line"), [e[1:] for e in PROMPT_ERRORS], ids=[e[0] for e in PROMPT_ERRORS])
def test_prompt_error(text, message, line):
    with _raises_at(line, message) as info:
        parse_prompt(text)
    assert info.value.line == line


@pytest.mark.parametrize(("body", "message", "line"), [e[1:] for e in CHECK_ERRORS], ids=[e[0] for e in CHECK_ERRORS])
def test_check_prompt_error(body, message, line):
    prompt = parse_prompt(f'<prompt schema="travel">\n{body}\n</prompt>')
    with _raises_at(line, message) as info:
        check_prompt(prompt, parse_schema(TRAVEL))
    assert info.value.line == line


def test_check_prompt_for_another_schema():
    with _raises_at(2, "the prompt is for schema 'hotel', not 'travel'"):
        check_prompt(parse_prompt('\n<prompt schema="hotel">\n</prompt>'), parse_schema(TRAVEL))


def test_nesting_up_to_the_limit_parses():
    assert len(parse_schema(_deep_schema(100)).modules()) == 99


@pytest.mark.parametrize("parse", [parse_schema, parse_prompt], ids=["schema", "prompt"])
def test_non_string_is_an_error_without_a_line(parse):
    with pytest.raises(PMLError, match=r"\APML must be a string, got bytes\Z") as info:
        parse(b'<schema name="s"/>')
    assert info.value.line is None


def test_pml_error_is_a_value_error():
    assert issubclass(PMLError, ValueError)


# ----- is_pml_prompt -----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<prompt schema='x'/>", True),
        ("  \n<prompt>", True),
        ('<prompt\nschema="x">', True),
        ("prompt", False),
        ("<prompts>", False),
        ("hello <prompt>", False),
        ("", False),
        (None, False),
        (b"<prompt>", False),
        (["<prompt>"], False),
    ],
    ids=[
        "self-closing",
        "leading-space",
        "newline-in-tag",
        "bare-word",
        "prompts",
        "text-first",
        "empty",
        "none",
        "bytes",
        "list",
    ],
)
def test_is_pml_prompt(text, expected):
    assert is_pml_prompt(text) is expected


# ----- property tests: arbitrary text raises nothing but PMLError -----

PROPERTY_SETTINGS = settings(max_examples=250, deadline=None, database=None)
TRAVEL_SCHEMA = parse_schema(TRAVEL)

FRAGMENTS = [
    "<", ">", "/", "=", '"', "'", "schema", "prompt", "module", "param", "union", "name", "len", "user", "system",
    " ", "\n", "\t", "&", "&amp;", "&lt;", "&#13;", "&#0;", "&bogus;", "<!--", "-->", "]]>", "<![CDATA[", "<?x ?>",
    "xml:space", "preserve", "0", "1", "42", "a", "b", "Z", "_", ":", "-", "\ud800", "\x00",
    '<schema name="s">', "</schema>", '<prompt schema="s">', "</prompt>", '<module name="m">', "</module>",
    '<param name="p" len="2"/>', "<union>", "</union>", "<user>", "</user>", "<m>", "</m>", '<m p="v"/>',
]  # fmt: skip
PML_ISH = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)

VALID_DOCUMENTS = [TRAVEL, TRIP, ESCAPED_SCHEMA, ESCAPED_PROMPT, WHITESPACE_SCHEMA]


def _only_pml_errors(text: str) -> None:
    """Parse ``text`` as a schema and as a prompt: PMLError is fine, any other exception fails the test, and
    whatever parses prints back to an equal document (and checks against a schema raising at most PMLError)."""
    for parse in (parse_schema, parse_prompt):
        try:
            document = parse(text)
        except PMLError:
            continue
        assert parse(to_pml(document)) == document
        if isinstance(document, Prompt):
            try:
                check_prompt(document, TRAVEL_SCHEMA)
            except PMLError:
                pass
    assert isinstance(is_pml_prompt(text), bool)


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(st.text())
def test_any_text_raises_only_pml_error(text):
    _only_pml_errors(text)


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(PML_ISH)
def test_pml_like_text_raises_only_pml_error(text):
    _only_pml_errors(text)


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(st.data())
def test_mutated_documents_raise_only_pml_error(data):
    document = data.draw(st.sampled_from(VALID_DOCUMENTS))
    start = data.draw(st.integers(0, len(document)), label="start")
    end = data.draw(st.integers(start, min(len(document), start + 30)), label="end")  # start == end: insert only
    replacement = data.draw(st.one_of(st.just(""), PML_ISH, st.text(max_size=5)), label="replacement")
    _only_pml_errors(document[:start] + replacement + document[end:])


# ----- property tests: generated documents round-trip through to_pml -----

RESERVED = {"schema", "prompt", "module", "param", "union", "system", "user", "assistant"}
NAME_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
NAMES = st.builds(operator.add, st.sampled_from(NAME_START), st.text(NAME_START + "0123456789.-", max_size=6)).filter(
    lambda name: name not in RESERVED
)
# Characters XML 1.0 cannot hold at all (even as a character reference) are left out: to_pml rejects them with a
# PMLError (tested above). Lone surrogates are not text at all.
XML_CHARS = st.characters(
    exclude_categories=["Cs"], exclude_characters="".join(map(chr, [*range(9), 11, 12, *range(14, 32), 0xFFFE, 0xFFFF]))
)
# Pieces, not characters: one_of over character strategies would merge them into one, and the few characters
# that matter here (whitespace, markup, quotes) would be drawn as rarely as any other.
PIECES = st.one_of(
    st.sampled_from([" ", "  ", "\n", "\n  ", "\t", "\r", "\r\n", "&", "&amp;", "<", ">", "]]>", '"', "'", "\x85"]),
    st.text(XML_CHARS, min_size=1, max_size=3),
)
# Any non-empty text round-trips, newlines and surrounding whitespace included: to_pml marks its output
# xml:space="preserve", so the whitespace rules for hand-written PML do not apply. Empty text is left out because
# the parser never makes an empty Text (an empty run is no node at all).
TEXTS = st.lists(PIECES, min_size=1, max_size=6).map("".join).map(Text)
ATTRIBUTE_VALUES = st.lists(PIECES, max_size=4).map("".join)


def _no_adjacent_texts(nodes: list) -> tuple:
    """Two texts in a row print as one run, which parses as one Text: join them as the parser would."""
    joined: list = []
    for node in nodes:
        if joined and isinstance(node, Text) and isinstance(joined[-1], Text):
            joined[-1] = Text(joined[-1].text + node.text)
        else:
            joined.append(node)
    return tuple(joined)


@st.composite
def schemas(draw) -> Schema:
    used: set[str] = set()

    def module_name() -> str:
        name = draw(NAMES)
        while name in used:
            name += "_"
        used.add(name)
        return name

    def module(depth: int, in_role: bool) -> Module:
        return Module(module_name(), children(depth + 1, True, in_role, set()))

    def children(depth: int, in_module: bool, in_role: bool, params: set[str]) -> tuple:
        kinds = ["text"] + ["param"] * in_module + ["module", "union"] * (depth < 2) + ["role"] * (not in_role)
        nodes = []
        for kind in draw(st.lists(st.sampled_from(kinds), max_size=3)):
            if kind == "text":
                nodes.append(draw(TEXTS))
            elif kind == "param":
                name = draw(NAMES.filter(lambda n: n not in params))
                params.add(name)
                nodes.append(Param(name, draw(st.integers(1, 10_000))))
            elif kind == "module":
                nodes.append(module(depth, in_role))
            elif kind == "union":
                nodes.append(Union(tuple(module(depth, in_role) for _ in range(draw(st.integers(1, 2))))))
            else:
                role = draw(st.sampled_from(["system", "user", "assistant"]))
                nodes.append(Role(role, children(depth, in_module, True, params)))  # a role's params are its module's
        return _no_adjacent_texts(nodes)

    name = draw(st.text(XML_CHARS, min_size=1, max_size=8).filter(str.strip))
    return Schema(name, children(0, False, False, set()))


@st.composite
def prompts(draw) -> Prompt:
    def children(depth: int, in_role: bool, in_import: bool) -> tuple:
        kinds = ["text"] + ["import"] * (depth < 2) + ["role"] * (not in_role and not in_import)
        nodes = []
        for kind in draw(st.lists(st.sampled_from(kinds), max_size=4)):
            if kind == "text":
                nodes.append(draw(TEXTS))
            elif kind == "import":
                args = draw(st.dictionaries(NAMES, ATTRIBUTE_VALUES, max_size=3))
                nodes.append(Import(draw(NAMES), tuple(args.items()), children(depth + 1, False, True)))
            else:
                role = draw(st.sampled_from(["system", "user", "assistant"]))
                nodes.append(Role(role, children(depth, True, False)))
        return _no_adjacent_texts(nodes)

    return Prompt(draw(ATTRIBUTE_VALUES), children(0, False, False))


def _importable(children: tuple) -> list[Module]:
    """The modules a prompt may import at this level: plain ones and the last member of each union."""
    found = []
    for node in children:
        if isinstance(node, Role):
            found += _importable(node.children)
        elif isinstance(node, Module):
            found.append(node)
        elif isinstance(node, Union):
            found.append(node.members[-1])
    return found


def _import_all(children: tuple) -> tuple:
    return tuple(
        Import(m.name, tuple((p, f"{p} value") for p in m.params()), _import_all(m.children))
        for m in _importable(children)
    )


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(schemas())
def test_generated_schema_round_trips(schema):
    assert parse_schema(to_pml(schema)) == schema


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(prompts())
def test_generated_prompt_round_trips(prompt):
    assert parse_prompt(to_pml(prompt)) == prompt


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(schemas())
def test_prompt_importing_every_allowed_module_checks(schema):
    check_prompt(parse_prompt(to_pml(Prompt(schema.name, _import_all(schema.children)))), schema)
    unknown = Prompt(schema.name, (*_import_all(schema.children), Import("not-a-module")))  # NAMES are shorter
    with pytest.raises(PMLError, match="no module 'not-a-module' at the top level"):
        check_prompt(unknown, schema)
