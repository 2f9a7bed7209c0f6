"""The layers of ``attention_spec``: the contract (every module directly in the package)
never imports ``attention_spec.interop`` at import time, and no modules of the package
import each other in a circle.

Read from the source with ``ast``: nothing is imported, so a layer broken by a lazy import
deep in some function is seen as well as one at the top of a file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "attention_spec"
INTEROP = "attention_spec.interop"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES: dict[str, Path] = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> Iterator[str]:
    """The modules of the package that one import statement of ``module`` imports."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the package that holds ``module``
        package = module if SOURCES[module].name == "__init__.py" else module.rpartition(".")[0]
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in SOURCES else base


def imports(module: str, *, at_import_time: bool) -> set[str]:
    """The modules of ``attention_spec`` that ``module`` imports: all of them, or only
    those imported when it is (not inside a function, nor under ``if TYPE_CHECKING:``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if at_import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(t for t in _targets(node, module) if t in SOURCES)
        if at_import_time and isinstance(node, ast.If) and _is_type_checking(node):
            children: list[ast.AST] = list(node.orelse)
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            visit(child)

    visit(ast.parse(SOURCES[module].read_text(), str(SOURCES[module])))
    found.discard(module)
    return found


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` ({module: modules it imports}) as a path that ends where it
    starts, or None."""
    done: set[str] = set()
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = walk(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = walk(start)
        if cycle:
            return cycle
    return None


def test_the_sources_are_read() -> None:
    core = {m for m in SOURCES if not m.startswith(INTEROP)}
    assert {"attention_spec", "attention_spec.registry", "attention_spec.options"} <= core
    assert {INTEROP, f"{INTEROP}.specs", f"{INTEROP}.packing", f"{INTEROP}.conversion"} <= set(SOURCES)
    assert imports(f"{INTEROP}.conversion", at_import_time=True) >= {"attention_spec.registry", f"{INTEROP}.specs"}
    # the lazy look-up of window_from_hf is seen, but not as an import at import time
    assert f"{INTEROP}.huggingface" in imports("attention_spec", at_import_time=False)
    assert f"{INTEROP}.huggingface" not in imports("attention_spec", at_import_time=True)


def test_the_core_imports_no_interop_at_import_time() -> None:
    core = sorted(m for m in SOURCES if not m.startswith(INTEROP))
    imported = {m: sorted(t for t in imports(m, at_import_time=True) if t.startswith(INTEROP)) for m in core}
    offenders = {m: targets for m, targets in imported.items() if targets}
    assert not offenders, f"the contract imports attention_spec.interop at import time: {offenders}"


def test_no_import_circle_among_the_modules() -> None:
    graph = {m: imports(m, at_import_time=False) for m in SOURCES}
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle: " + " -> ".join(cycle or ())


def test_find_cycle_finds_a_lazy_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
