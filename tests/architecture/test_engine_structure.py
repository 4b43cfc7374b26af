"""The engine is its loop: the technique branches, KV bookkeeping and parallelism live in the parts it calls.

Counts read from the source with ``ast``, so a change that brings a technique's wiring back into ``core/engine.py``
or parallelism into the runner fails here, naming the line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "kvserve" / "core"
# Words that name a technique in a condition: tensor parallelism, parallel prefill, Prompt Cache, window groups,
# compression policies, offloading.
TECHNIQUE_WORDS = (
    "tensor_parallel", "parallel_prefill", "prefill_parallel", "prompt_cache", "pml", "module", "encod", "window",
    "policy", "budget", "offload", "tier", "swap",
)  # fmt: skip
MAX_TECHNIQUE_CONDITIONS = 5


def _conditions(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        tests = []
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Try):
            tests.extend(h.type for h in node.handlers if h.type is not None)  # `except KVTierError` branches too
        for test in tests:
            source = ast.unparse(test)
            if any(word in source.lower() for word in TECHNIQUE_WORDS):
                found.append((test.lineno, source))
    return found


def test_the_engine_branches_on_techniques_at_most_five_times():
    found = _conditions(CORE / "engine.py")
    listing = "\n".join(f"  engine.py:{line}: {source}" for line, source in found)
    assert len(found) <= MAX_TECHNIQUE_CONDITIONS, f"{len(found)} technique conditions in core/engine.py:\n{listing}"


def test_the_condition_counter_sees_a_technique_branch():
    sample = Path(__file__).with_name("sample_engine.py.txt")
    sample.write_text("if self.tensor_parallel is not None:\n    pass\nx = 1 if config.kv_offload else 2\n")
    try:
        assert [line for line, _ in _conditions(sample)] == [1, 3]
    finally:
        sample.unlink()


@pytest.mark.parametrize("name", ["group_slots", "group_heads", "num_computed_tokens"])
def test_the_engine_keeps_no_kv_bookkeeping(name):
    text = (CORE / "engine.py").read_text()
    assert name not in text, f"core/engine.py touches {name}: KV bookkeeping belongs to the scheduler"


def test_the_runner_knows_nothing_of_parallelism():
    tree = ast.parse((CORE / "runner.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.startswith("kvserve.parallel")}, imported
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"tensor_parallel", "run_step", "lose", "takes"}, names  # `out.parallel_prefill` is the tag
