"""The KV backends stay made of parts: no class in kvserve/attention/ over 300 lines, and no backend that asks a
policy's class what it is (backends dispatch on what a policy declares, ``KVPolicy``'s attributes and methods)."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import kvserve

ATTENTION = Path(kvserve.__file__).parent / "attention"
MAX_CLASS_LINES = 300


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(ATTENTION.glob("*.py"))]


def test_no_class_in_attention_exceeds_300_lines() -> None:
    long = [
        f"{path.name}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def _policy_names(tree: ast.Module) -> set[str]:
    """Names a module binds from kvserve.policies (``from kvserve.policies... import X`` or ``import ... as m``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvserve.policies"):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(
                alias.asname or alias.name for alias in node.names if alias.name.startswith("kvserve.policies")
            )
    return names


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id in names) or (isinstance(n, ast.Attribute) and n.attr in names)
        for n in ast.walk(node)
    )


def test_attention_asks_no_policy_class_what_it_is() -> None:
    found = []
    for path, tree in _modules():
        names = _policy_names(tree)
        for node in ast.walk(tree):
            is_check = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if is_check and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                if _mentions(node.args[1], names):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, f"isinstance/issubclass on kvserve.policies classes: {found}"


def test_step_metadata_carries_no_step_state() -> None:
    """Metadata is the step's immutable description; what the layers fill in is an object the cache makes beside it."""
    from kvserve.attention.compressed_metadata import CompressedAttentionMetadata
    from kvserve.attention.offload_metadata import OffloadAttentionMetadata
    from kvserve.attention.paged_metadata import PagedAttentionMetadata

    for cls in (CompressedAttentionMetadata, OffloadAttentionMetadata, PagedAttentionMetadata):
        assert cls.__dataclass_params__.frozen, cls.__name__
        assert "state" not in {f.name for f in dataclasses.fields(cls)}, cls.__name__
        assert not any(isinstance(v, functools.cached_property) for v in vars(cls).values()), cls.__name__
