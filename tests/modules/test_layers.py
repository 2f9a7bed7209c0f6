"""The layers of ``attention_spec``: the contract (every module directly in the package)
never imports ``attention_spec.interop`` at import time; and no import circle among the
modules of the four product packages (``torch_attention``, ``jax_attention``,
``attention_spec``, ``parity_tests``), counting every import: at module level, inside a
function, under ``if TYPE_CHECKING:``.

Read from the source with ``ast``: nothing is imported, so a layer broken by a lazy import
deep in some function is seen as well as one at the top of a file.  An import of
``a.b.c`` counts as an import of ``a.b.c`` (or of the nearest module above it that is a
file of the packages), not of the packages above it that Python initialises first: a
package's ``__init__`` imports its own modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attention_spec"
INTEROP = "attention_spec.interop"
PRODUCT = ("torch_attention", "jax_attention", "attention_spec", "parity_tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES: dict[str, Path] = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
PRODUCT_SOURCES: dict[str, Path] = {
    module_name(path): path for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _known(name: str, sources: Mapping[str, Path]) -> str | None:
    """``name``, or the nearest module above it among ``sources`` (None: none is)."""
    while name and name not in sources:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, sources: Mapping[str, Path]) -> Iterator[str]:
    """The modules of ``sources`` that one import statement of ``module`` imports."""
    if isinstance(node, ast.Import):
        yield from (t for alias in node.names if (t := _known(alias.name, sources)))
        return
    base = node.module or ""
    if node.level:  # relative: from the package that holds ``module``
        package = module if sources[module].name == "__init__.py" else module.rpartition(".")[0]
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in sources else base


def imports(module: str, *, at_import_time: bool, sources: Mapping[str, Path] = SOURCES) -> set[str]:
    """The modules of ``sources`` (``attention_spec``'s by default) that ``module``
    imports: all of them, or only those imported when it is (not inside a function, nor
    under ``if TYPE_CHECKING:``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if at_import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(t for t in _targets(node, module, sources) if t in sources)
        if at_import_time and isinstance(node, ast.If) and _is_type_checking(node):
            children: list[ast.AST] = list(node.orelse)
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            visit(child)

    visit(ast.parse(sources[module].read_text(), str(sources[module])))
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


def knots(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every set of modules of ``graph`` that import each other, in a circle or in
    several (a strongly connected component of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def circle_in(graph: Mapping[str, set[str]], knot: list[str]) -> list[str]:
    """One circle through the modules of ``knot`` (``find_cycle`` within it)."""
    members = set(knot)
    cycle = find_cycle({m: graph[m] & members for m in knot})
    assert cycle is not None, knot
    return cycle


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


def test_the_product_sources_are_read() -> None:
    assert {"torch_attention", "jax_attention", "attention_spec", "parity_tests"} <= set(PRODUCT_SOURCES)
    assert {"jax_attention.functional", "torch_attention._hf", "parity_tests.reference", INTEROP} <= set(PRODUCT_SOURCES)
    sources = PRODUCT_SOURCES
    # module level, relative to the package, and a name of a package's __init__
    assert "jax_attention.functional" in imports("jax_attention", at_import_time=True, sources=sources)
    assert "jax_attention._cpu_kernel" in imports("jax_attention._cpu_fused", at_import_time=True, sources=sources)
    # an import of the other packages counts (the harness imports the twins inside functions)
    assert "torch_attention" in imports("parity_tests.harness", at_import_time=False, sources=sources)
    assert "torch_attention" not in imports("parity_tests.harness", at_import_time=True, sources=sources)


# The knots known to remain (``knots``): none may be added, and one untied leaves this list.
KNOWN_KNOTS: list[list[str]] = []


def test_no_import_circle_in_the_product_packages() -> None:
    """Every import counts, the lazy ones and those under ``TYPE_CHECKING`` too: a circle
    closed by an import inside a function is still one module needing the other."""
    graph = {m: imports(m, at_import_time=False, sources=PRODUCT_SOURCES) for m in PRODUCT_SOURCES}
    found = knots(graph)
    new = [knot for knot in found if knot not in KNOWN_KNOTS]
    assert not new, "import circles in the product packages:\n" + "\n".join(
        f"{', '.join(knot)}: " + " -> ".join(circle_in(graph, knot)) for knot in new)
    untied = [knot for knot in KNOWN_KNOTS if knot not in found]
    assert not untied, f"no circle among these any more, to leave KNOWN_KNOTS: {untied}"


def test_find_cycle_finds_a_lazy_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_knots_finds_every_circle() -> None:
    assert knots({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"e", "g"}, "e": {"c"}, "f": {"a"}, "g": {"d"}}
    assert knots(graph) == [["a", "b"], ["c", "d", "e", "g"]]
    assert circle_in(graph, ["a", "b"]) == ["a", "b", "a"]
    assert circle_in(graph, ["c", "d", "e", "g"]) == ["c", "d", "e", "c"]
