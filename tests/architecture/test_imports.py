"""kvserve's modules import in one direction: no import cycles, and no import from a lower layer up to a higher one.

Every import counts: at module level, inside functions and under ``if TYPE_CHECKING:`` alike, since a lazy import
is still a dependency. The graph comes from the source (``ast``); nothing is imported.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvserve"

# Lowest first. A module belongs to the layer of the longest prefix that names it (``kvserve.core.step`` is a
# contract below the rest of ``kvserve.core``). A module may import its own layer and those below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Foundation: errors, logging, the machine and runtime (devices, kernels, extras); tenant hashing; GGUF parsing.
    ("kvserve.errors", "kvserve.log", "kvserve.platform", "kvserve.core.isolation", "kvserve.models.gguf_reader"),
    ("kvserve.kv",),  # KV bookkeeping: blocks, prefix hashes, tiers, sizes; no tensors of keys or values
    ("kvserve.text",),  # tokenizers, detokenizer, prompts (the tokenizer reads a GGUF file's vocabulary)
    ("kvserve.structured",),  # guided decoding: grammars matched over a tokenizer's vocabulary
    # The contracts: the step's plain data, the attention-backend interface a model calls, and the KVPolicy
    # interface the caches call (with the score math it rests on). Models and caches implement them.
    (
        "kvserve.core.step",
        "kvserve.attention.backend",
        "kvserve.attention.softcap",
        "kvserve.policies.base",
        "kvserve.policies.scoring",
    ),
    ("kvserve.models",),  # model families, weights, loader: they call the attention backend they are given
    ("kvserve.policies", "kvserve.attention"),  # the policies (some use model layers) and the caches that run them
    ("kvserve.sampling",),  # sampling parameters validate a request's KV policy by building it
    ("kvserve.config",),  # EngineConfig validates against the models' dtypes and weights, kv tiers and policies
    ("kvserve.prompt_cache", "kvserve.parallel"),  # module KV over the pool; prefill across processes
    # The engine: scheduler, runner, KV plan and cache, requests. The tensor-parallel group builds a runner in each
    # worker, so it sits here.
    ("kvserve.core", "kvserve.parallel.tensor_group"),
    ("kvserve", "kvserve.entrypoints"),  # the package's public names and the offline API (LLM, engine arguments)
    ("kvserve.eval", "kvserve.bench", "kvserve.server"),  # what runs an engine: evaluation, benchmarks, the server
    ("kvserve.entrypoints.cli", "kvserve.__main__"),  # the command, which registers every subcommand
)


@cache
def module_files() -> dict[str, Path]:
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return paths


@cache
def import_graph() -> dict[str, list[tuple[str, int, str]]]:
    """Each module's kvserve imports: (imported module, line, the import as written)."""
    paths = module_files()

    def resolve(name: str) -> str:
        while name not in paths:  # a name imported from a module: the module
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            else:
                continue
            for name in names:
                if name == "kvserve" or name.startswith("kvserve."):
                    target = resolve(name)
                    if target != module:
                        edges.append((target, node.lineno, ast.unparse(node)))
        graph[module] = edges
    return graph


def layer_of(module: str) -> int:
    """The layer of the longest prefix naming ``module`` ("kvserve" names the package's ``__init__`` only)."""
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix != "kvserve" and module.startswith(prefix + "."))
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def cycles(graph: dict[str, list[tuple[str, int, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    successors = {m: sorted({t for t, _, _ in edges}) for m, edges in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(successors):
        if root in index:
            continue
        work = [(root, iter(successors[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{module_files()[module].relative_to(PACKAGE.parent)}:{line}: {statement}"
        f"  (layer {layer_of(module)} imports {target}, layer {layer_of(target)})"
        for module, edges in sorted(import_graph().items())
        for target, line, statement in edges
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)
