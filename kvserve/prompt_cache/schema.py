"""Schema layout: every module's tokens at the positions its place in the schema gives it; prompts bound to it.

Prompt Cache's rule (Gim et al., MLSys'24, §3.3): a module's attention states are reusable only at the
positions they were computed at, so the schema fixes them. Walking the schema in order with a
position cursor:

- text (and role framing from the chat template) takes the next positions of the module it is in;
- a ``<param len=N>`` reserves N positions; a prompt's argument fills the first ones of them;
- a nested module starts where it stands and the cursor continues after it;
- the members of a ``<union>`` all start at the union's start; the union spans its longest member.

A prompt's new text (its own text and role tags, and the generation prompt after a closing
``<user>``) takes positions after the whole schema, in the order written, as the authors' code does.
Each text run is tokenized on its own (module boundaries are token boundaries); the schema's own
text starts with BOS when the tokenizer adds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
)
from kvserve.prompt_cache.roles import RoleFrames
from kvserve.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ParamSlot:
    name: str
    start: int  # first reserved position
    length: int  # reserved positions = the longest argument in tokens
    line: int = 0


@dataclass
class ModuleLayout:
    """One module's own tokens (nested modules and parameters excluded) and their positions."""

    name: str  # "" for the schema's own text
    start: int
    end: int = 0  # one past the last position the module spans (nested modules and params included)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    params: dict[str, ParamSlot] = field(default_factory=dict)


@dataclass(frozen=True)
class SchemaLayout:
    schema: Schema
    modules: dict[str, ModuleLayout]  # "" = the schema's own text, then every named module
    length: int  # positions the schema spans; a prompt's new text starts here

    @classmethod
    def build(
        cls, schema: Schema, tokenizer: Tokenizer, frames: RoleFrames | None, max_model_len: int | None = None
    ) -> SchemaLayout:
        """``frames``: ``RoleFrames.from_tokenizer(tokenizer)`` (None: the model has no chat template)."""
        builder = _LayoutBuilder(tokenizer, frames)
        root = ModuleLayout("", 0)
        if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
            builder.add_tokens(root, [tokenizer.bos_token_id])
        elif frames is not None and frames.opening:  # the template's own opening, where the tokenizer adds none
            builder.add_tokens(root, tokenizer.encode(frames.opening, add_special_tokens=False))
        builder.walk(schema.children, root)
        root.end = builder.cursor
        modules = {"": root, **builder.modules}
        if max_model_len is not None and builder.cursor >= max_model_len:
            raise PMLError(
                f"schema {schema.name!r} spans {builder.cursor} positions; the context is {max_model_len} and "
                "prompts need room for new text",
                schema.line,
            )
        return cls(schema, modules, builder.cursor)

    def shared_prefix(self) -> tuple[list[int], list[int]]:
        """The schema's own tokens before its first module (BOS, the system turn, ...), with their positions: a
        prefix of every prompt of the schema, so a module may be encoded after it, as in the plain prompt."""
        first = min((m.start for name, m in self.modules.items() if name), default=self.length)
        root = self.modules[""]
        n = sum(1 for position in root.positions if position < first)
        return root.token_ids[:n], root.positions[:n]

    def bind(
        self, prompt: Prompt, tokenizer: Tokenizer, frames: RoleFrames | None, max_model_len: int | None = None
    ) -> PromptLayout:
        """The modules a prompt imports and its uncached tokens with their positions."""
        check_prompt(prompt, self.schema)
        binder = _PromptBinder(self, tokenizer, frames)
        binder.walk(prompt.children)
        if binder.last_role == "user":
            binder.add_text(binder.frames.generation_prompt)
        layout = PromptLayout(binder.imported, binder.token_ids, binder.positions)
        if not layout.token_ids:
            raise PMLError(
                "the prompt adds no new text after its modules; the model needs at least one uncached token to "
                "start from (add text, or a <user> turn)",
                prompt.line,
            )
        end = max(layout.positions) + 1
        if max_model_len is not None and end >= max_model_len:
            raise PMLError(f"the prompt reaches position {end}; the context is {max_model_len} positions, and at "
                           "least one must be left to generate", prompt.line)  # fmt: skip
        return layout


@dataclass(frozen=True)
class PromptLayout:
    modules: list[str]  # imported module names ("" first), each module's KV cached
    token_ids: list[int]  # uncached tokens (arguments, new text) in the order written
    positions: list[int]  # their positions


class _LayoutBuilder:
    def __init__(self, tokenizer: Tokenizer, frames: RoleFrames | None) -> None:
        self.tokenizer, self.frames = tokenizer, frames
        self.cursor = 0
        self.modules: dict[str, ModuleLayout] = {}

    def add_tokens(self, module: ModuleLayout, ids: list[int]) -> None:
        module.token_ids += ids
        module.positions += range(self.cursor, self.cursor + len(ids))
        self.cursor += len(ids)

    def walk(self, nodes: tuple, module: ModuleLayout) -> None:
        for node in nodes:
            if isinstance(node, Text):
                self.add_tokens(module, self.tokenizer.encode(node.text, add_special_tokens=False))
            elif isinstance(node, Role):
                prefix, suffix = _frame(self.frames, node)
                self.add_tokens(module, self.tokenizer.encode(prefix, add_special_tokens=False))
                self.walk(node.children, module)
                self.add_tokens(module, self.tokenizer.encode(suffix, add_special_tokens=False))
            elif isinstance(node, Param):
                module.params[node.name] = ParamSlot(node.name, self.cursor, node.length, node.line)
                self.cursor += node.length
            elif isinstance(node, Module):
                self.module(node)
            elif isinstance(node, Union):
                start, end = self.cursor, self.cursor
                for member in node.members:
                    self.cursor = start
                    end = max(end, self.module(member).end)
                self.cursor = end

    def module(self, node: Module) -> ModuleLayout:
        layout = ModuleLayout(node.name, self.cursor)
        self.modules[node.name] = layout
        self.walk(node.children, layout)
        layout.end = self.cursor
        return layout


class _PromptBinder:
    def __init__(self, layout: SchemaLayout, tokenizer: Tokenizer, frames: RoleFrames | None) -> None:
        self.layout, self.tokenizer, self.frames = layout, tokenizer, frames
        self.imported = [""]
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.cursor = layout.length
        self.last_role: str | None = None

    def add_text(self, text: str) -> None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.token_ids += ids
        self.positions += range(self.cursor, self.cursor + len(ids))
        self.cursor += len(ids)

    def walk(self, nodes: tuple) -> None:
        for node in nodes:
            if isinstance(node, Text):
                self.add_text(node.text)
                self.last_role = None
            elif isinstance(node, Role):
                prefix, suffix = _frame(self.frames, node)
                self.add_text(prefix)
                self.walk(node.children)
                self.add_text(suffix)
                self.last_role = node.role
            elif isinstance(node, Import):
                self.import_module(node)

    def import_module(self, node: Import) -> None:
        module = self.layout.modules[node.name]
        self.imported.append(node.name)
        for name, value in node.args:
            slot = module.params[name]
            ids = self.tokenizer.encode(value, add_special_tokens=False)
            if len(ids) > slot.length:
                raise PMLError(
                    f"argument {name}={value[:40]!r} of module {node.name!r} is {len(ids)} tokens; the parameter "
                    f"reserves len={slot.length} (declared on line {slot.line})",
                    node.line,
                )
            self.token_ids += ids
            self.positions += range(slot.start, slot.start + len(ids))
        self.walk(node.children)


def _frame(frames: RoleFrames | None, node: Role) -> tuple[str, str]:
    if frames is None:
        raise PMLError(f"<{node.role}> needs a chat template, and this model has none", node.line)
    return frames.prefix[node.role], frames.suffix[node.role]
