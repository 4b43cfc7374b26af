"""The engine's Prompt Cache: registered schemas, their modules in the ``ModuleStore``, prompts prepared for it.

``prepare`` turns a PML prompt into what the scheduler runs: the imported modules' tokens first (their
full blocks shared, their partial last blocks copied), then the prompt's uncached tokens (arguments and
new text), each with its schema position. Attention then reads every module's cached keys and values,
and only the uncached tokens go through the model before the first sampled token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from kvserve.config import HEAD_BUDGETS_AND_MODULES
from kvserve.core.isolation import GLOBAL_NAMESPACE, qualified_name
from kvserve.prompt_cache.cached_module import CachedModule
from kvserve.prompt_cache.cached_prompt import CachedPrompt
from kvserve.prompt_cache.pml import PMLError, parse_prompt, parse_schema
from kvserve.prompt_cache.recompute import plan_recompute
from kvserve.prompt_cache.roles import RoleFrames
from kvserve.prompt_cache.schema import SchemaLayout
from kvserve.prompt_cache.store import ModuleBlocks, ModuleStore
from kvserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.policies import KVPolicy
    from kvserve.sampling.sampling_params import SamplingParams

# A schema's name goes in URLs (/v1/schemas/{name}) and log lines: a '/' or a leading '.' could never be
# read or deleted there, so neither can be registered.
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
SCHEMA_NAME_RULE = "1 to 64 of A-Z a-z 0-9 . _ - (not starting with '.')"


def check_schema_name(name: str, line: int | None = None) -> None:
    """Raise ``PMLError`` unless ``name`` follows ``SCHEMA_NAME_RULE``."""
    if SCHEMA_NAME.fullmatch(name) is None:
        shown = repr(name) if len(name) <= 80 else repr(name[:77]) + "..."
        raise PMLError(f"schema name {shown} is not allowed: a schema name is {SCHEMA_NAME_RULE}", line)


def check_module_prompt(policy: KVPolicy, params: SamplingParams, score_from: int) -> None:
    """Raise ValueError for a PML prompt the request's options cannot serve."""
    if policy.head_budgets:
        raise ValueError(HEAD_BUDGETS_AND_MODULES.format(name=policy.name))
    if params.prompt_logprobs is not None or score_from:
        raise ValueError("prompt_logprobs need every prompt position's logits; a PML prompt computes only its "
                         "uncached tokens (send the prompt as plain text to score it)")  # fmt: skip


@dataclass(frozen=True)
class SchemaInfo:
    """What a client may read about a registered schema."""

    name: str
    num_positions: int  # positions the schema spans
    modules: dict[str, dict]  # module -> {"start", "end", "tokens", "params": {name: len}, "cached"}

    def to_dict(self) -> dict:
        return {"name": self.name, "num_positions": self.num_positions, "modules": self.modules}


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]  # module tokens (shared blocks, then copied tails), then the uncached tokens
    positions: list[int]
    cached: CachedPrompt
    modules: list[CachedModule]  # pinned: unpin when the request ends
    num_uncached: int
    salt: tuple  # prefix-cache salt: equal for prompts with equal modules and positions


@dataclass(frozen=True)
class _Registered:
    name: str
    namespace: str
    text: str
    layout: SchemaLayout


class PromptCache:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        store: ModuleStore,
        eager: bool,
        recompute: float = 0.0,
        module_context: bool = False,
        probe_window: int | None = None,
    ) -> None:
        """``recompute``: share of a prompt's imported module tokens recomputed across modules (``recompute.py``).
        ``module_context``: modules are encoded after the schema's shared prefix (``SchemaLayout.shared_prefix``).
        ``probe_window``: the model's layer 0 window, if it has one (which candidates recompute's selection probes)."""
        self.tokenizer, self.max_model_len, self.store, self.eager = tokenizer, max_model_len, store, eager
        self.recompute, self.module_context, self.probe_window = recompute, module_context, probe_window
        self._schemas: dict[str, _Registered] = {}

    @cached_property
    def frames(self) -> RoleFrames | None:
        """The chat template's role framing, rendered once (on first use: a template it cannot cut raises then)."""
        return RoleFrames.from_tokenizer(self.tokenizer)

    # ----- schemas -----

    # Every method takes the caller's ``namespace`` (``kvserve/core/isolation.py``): names resolve within it, and a
    # schema of another namespace is as unknown as one never registered. Registry and store keys are qualified.

    def register(self, pml_text: str, namespace: str = GLOBAL_NAMESPACE) -> SchemaInfo:
        """Parse, lay out and store a schema's modules (encoding them now when eager). Registering the same
        text again is a no-op; another schema under a taken name is an error (remove it first)."""
        schema = parse_schema(pml_text)
        check_schema_name(schema.name, schema.line)
        key = qualified_name(namespace, schema.name)
        known = self._schemas.get(key)
        if known is not None:
            if known.text == pml_text:
                return self.info(schema.name, namespace)
            raise PMLError(f"a different schema named {schema.name!r} is registered; delete it first", schema.line)
        layout = SchemaLayout.build(schema, self.tokenizer, self.frames, self.max_model_len)
        self._schemas[key] = _Registered(schema.name, namespace, pml_text, layout)
        try:
            for name, module in layout.modules.items():
                if module.token_ids:
                    self.store.add(
                        (key, name), module.token_ids, module.positions, self.eager, self._context(layout, name)
                    )
        except Exception:
            self.remove(schema.name, namespace)
            raise
        return self.info(schema.name, namespace)

    def remove(self, name: str, namespace: str = GLOBAL_NAMESPACE) -> None:
        key = qualified_name(namespace, name)
        registered = self._schemas.pop(key, None)
        if registered is None:
            raise KeyError(_unknown(name))
        for module in registered.layout.modules:
            self.store.remove((key, module))

    def encoding(self, name: str, namespace: str = GLOBAL_NAMESPACE) -> bool:
        """Whether any of schema ``name``'s modules is queued or running to be encoded."""
        key = qualified_name(namespace, name)
        return any(m.encoding for k, m in self.store.modules.items() if k[0] == key)

    def names(self, namespace: str = GLOBAL_NAMESPACE) -> list[str]:
        return sorted(r.name for r in self._schemas.values() if r.namespace == namespace)

    def info(self, name: str, namespace: str = GLOBAL_NAMESPACE) -> SchemaInfo:
        key = qualified_name(namespace, name)
        registered = self._schemas.get(key)
        if registered is None:
            raise KeyError(_unknown(name))
        modules = {}
        for module_name, module in registered.layout.modules.items():
            stored = self.store.modules.get((key, module_name))
            modules[module_name] = {
                "start": module.start, "end": module.end, "tokens": len(module.token_ids),
                "params": {p.name: p.length for p in module.params.values()},
                "cached": stored is not None and stored.encoded,
            }  # fmt: skip
        return SchemaInfo(name, registered.layout.length, modules)

    # ----- prompts -----

    def prepare(self, pml_text: str, namespace: str = GLOBAL_NAMESPACE) -> PreparedPrompt:
        """Bind a PML prompt to its schema and pin its modules' KV in device blocks (an encoding queued for any
        not yet encoded: ``store.take_encode_jobs``). The caller unpins ``modules`` when the request ends."""
        prompt = parse_prompt(pml_text)
        check_schema_name(prompt.schema, prompt.line)
        key = qualified_name(namespace, prompt.schema)
        registered = self._schemas.get(key)
        if registered is None:
            # Other clients' schema names are not this client's business: name only the one asked for.
            raise PMLError(f"unknown schema {prompt.schema!r}: no schema of that name is registered", prompt.line)
        layout = registered.layout.bind(prompt, self.tokenizer, self.frames, self.max_model_len)
        pinned: list[ModuleBlocks] = []
        try:
            for name in layout.modules:
                module = self._stored(key, name, registered.layout)
                if module is not None:
                    pinned.append(self.store.pin(module))
        except Exception:
            for blocks in pinned:
                self.store.unpin(blocks.module)
            raise
        prepared = _assemble(
            pinned, layout.token_ids, layout.positions, self.store.kv.block_size, (key, registered.text)
        )
        if self.recompute > 0 and not self.store.per_layer_groups:
            return _with_recompute(prepared, pinned, self.store.kv.block_size, self.recompute, self.probe_window)
        return prepared

    def _stored(self, schema: str, name: str, layout: SchemaLayout) -> CachedModule | None:
        """The module's store entry, added back (to encode on use) if it was evicted; None for no tokens."""
        module = layout.modules[name]
        if not module.token_ids:
            return None
        stored = self.store.modules.get((schema, name))
        if stored is not None:
            return stored
        return self.store.add((schema, name), module.token_ids, module.positions, False, self._context(layout, name))

    def _context(self, layout: SchemaLayout, name: str) -> tuple[list[int], list[int]]:
        """What module ``name`` attends to while encoded: the schema's shared prefix (not for the schema's own
        text, which holds it)."""
        return layout.shared_prefix() if self.module_context and name else ([], [])

    def release(self, modules: list[CachedModule]) -> None:
        for module in modules:
            self.store.unpin(module)


def _unknown(name: str) -> str:
    return f"no schema named {name!r} is registered"


def _assemble(
    pinned: list[ModuleBlocks], uncached: list[int], uncached_positions: list[int], block_size: int, schema: tuple
) -> PreparedPrompt:
    """Slot order: every module's full blocks (shared), every module's tail (copied), the uncached tokens.
    Attention does not care about slot order; RoPE put each position in its key already. (Token order follows
    the first KV group's slots; with a group per layer, each layer's slots are its own and only the count of
    module tokens matters.)"""
    token_ids: list[int] = []
    positions: list[int] = []
    for blocks in pinned:
        n = len(blocks.full_blocks) * block_size
        token_ids += blocks.module.token_ids[:n]
        positions += blocks.module.positions[:n]
    tail_slots: list[int] = []
    for blocks in pinned:
        n = len(blocks.full_blocks) * block_size
        token_ids += blocks.module.token_ids[n:]
        positions += blocks.module.positions[n:]
        tail_slots += blocks.tail_slots
    token_ids += uncached
    positions += uncached_positions
    shared = tuple(b for blocks in pinned for b in blocks.full_blocks)
    # The sequences whose encodings the prompt waits for: a module encoded after a context runs in a scratch one.
    module_seqs = tuple(blocks.module.encode_seq_id or blocks.module.seq_id for blocks in pinned)
    num_tokens = sum(m.module.num_tokens for m in pinned)
    # Sliding-window KV groups: the same order in each group's blocks (all modules' full blocks, then the tails).
    num_groups = max((len(b.group_blocks) for b in pinned), default=0)
    group_shared = tuple(tuple(x for b in pinned for x in b.group_blocks[g]) for g in range(num_groups))
    group_tails = tuple(tuple(x for b in pinned for x in b.group_tails[g]) for g in range(num_groups))
    cached = CachedPrompt(shared, tuple(tail_slots), module_seqs, group_shared, group_tails, num_tokens)
    # ``schema``: its qualified name and text, so another namespace's copy of the schema never shares the blocks.
    digest = hashlib.sha256(repr((schema, tuple(token_ids), tuple(positions))).encode()).hexdigest()
    return PreparedPrompt(
        token_ids, positions, cached, [b.module for b in pinned], len(uncached), ("prompt-cache", digest)
    )  # fmt: skip


def _with_recompute(
    prepared: PreparedPrompt, pinned: list[ModuleBlocks], block_size: int, share: float, probe_window: int | None
) -> PreparedPrompt:
    """The prompt with selective recompute: the candidates to rewrite, and the full blocks holding any of them
    copied into the request's own blocks (their slots go before the tails: token order is unchanged)."""
    cached = prepared.cached
    owners = [i for i, b in enumerate(pinned) for _ in range(len(b.full_blocks) * block_size)]
    owners += [i for i, b in enumerate(pinned) for _ in range(len(b.tail_slots))]
    contexts = [b.module.context_positions for b in pinned]
    positions = prepared.positions[: len(owners)]
    plan = plan_recompute(owners, positions, len(cached.shared_blocks), block_size, share, contexts, probe_window)
    if not plan.count:
        return prepared
    copied = [b * block_size + j for b in cached.shared_blocks[plan.num_shared :] for j in range(block_size)]
    cached = dataclasses.replace(
        cached, shared_blocks=cached.shared_blocks[: plan.num_shared], tail_slots=(*copied, *cached.tail_slots),
        recompute=plan.candidates, recompute_count=plan.count, recompute_probe=plan.probe,
    )  # fmt: skip
    return dataclasses.replace(prepared, cached=cached, salt=(*prepared.salt, "recompute", repr(share)))
