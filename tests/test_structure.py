"""The package's shape (STYLE.md): no import cycle among tiered_kv's modules, one concept per module
of a few hundred lines at most, and no component of the store that takes the whole TierStore. Read
from the source with ast; nothing is imported.

An import counts wherever it is written: at the top, inside a function (a lazy import hides a cycle,
it does not remove it) or under `if TYPE_CHECKING`. `from a import b` names module `a.b` when that
is a module, else `a` itself. The known exceptions sit in files this check's change could not edit;
each must still be there (the test says so once one is gone: take it off the list).
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tiered_kv"
MAX_MODULE_LINES = 350

# (importer, imported): import edges that close a cycle, to be removed later
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
# modules over MAX_MODULE_LINES, to be split later
KNOWN_LONG_MODULES: set[str] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, is_package: bool, node: ast.AST, modules: dict) -> list[str]:
    """The tiered_kv modules one import statement names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                   for alias in node.names]
    found = []
    for target in targets:
        while target not in modules and "." in target:  # `import tiered_kv.a.b` names tiered_kv.a.b
            target = target.rsplit(".", 1)[0]
        if target in modules and target.startswith("tiered_kv"):
            found.append(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_imported(module, path.name == "__init__.py", node, modules))
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_package_modules():
    graph = import_graph()
    for importer, imported in KNOWN_CYCLE_EDGES:
        assert imported in graph[importer], f"{importer} no longer imports {imported}: take it off KNOWN_CYCLE_EDGES"
        graph[importer] = graph[importer] - {imported}
    found = cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(cycle))}" for m in cycle) for cycle in found]
    assert found == [], "import cycles (counting imports inside functions):\n" + "\n".join(described)
    for importer, imported in KNOWN_CYCLE_EDGES:  # each exception still closes a cycle (else it is not needed)
        assert any(imported in cycle and importer in cycle for cycle in cycles(import_graph())), (importer, imported)


def test_no_module_over_the_line_limit():
    lengths = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in _modules().items()}
    long = {module: n for module, n in lengths.items() if n > MAX_MODULE_LINES}
    assert set(long) - KNOWN_LONG_MODULES == set(), f"over {MAX_MODULE_LINES} lines (one concept per module): {long}"
    assert KNOWN_LONG_MODULES - set(long) == set(), "split already: take these off KNOWN_LONG_MODULES"


STORE_FACADE = ("tier_store.py", "__init__.py")  # the façade that builds and holds the TierStore; its export


def store_holders(source: str) -> list[str]:
    """Where a module takes or keeps the whole store: a parameter named `store`, an attribute named
    `store` or `_store...` (set or read: `self.store = store`, `opening.store`), or the name
    TierStore (an import or an annotation)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg == "store":
            found.append((node.lineno, "parameter `store`"))
        elif isinstance(node, ast.Attribute) and (node.attr == "store" or node.attr.startswith("_store")):
            found.append((node.lineno, f"attribute `.{node.attr}`"))
        elif isinstance(node, ast.Name) and node.id == "TierStore" or \
                isinstance(node, ast.alias) and "TierStore" in (node.name, node.asname):
            found.append((node.lineno, "the name TierStore"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_the_store_holder_finder_finds_what_a_component_of_the_old_shape_did():
    old = ("class Opening:\n    def __init__(self, store):\n        self.store = store\n"
           "class StepBuild:\n    def __init__(self, opening):\n        self.store = opening.store\n"
           "def flush(store, timeout_s): pass\n")
    assert store_holders(old) == ["2: parameter `store`", "3: attribute `.store`", "6: attribute `.store`",
                                  "6: attribute `.store`", "7: parameter `store`"]
    new = "class Opening:\n    def __init__(self, lock, state, mover):\n        self.lock, self.state = lock, state\n"
    assert store_holders(new) == []


def test_no_component_of_the_store_takes_the_whole_store():
    """Each component gets the collaborators it uses, passed explicitly (docs/design.md): only the
    façade builds, holds and wires them."""
    found = {path.name: holders for path in sorted((PACKAGE / "store").glob("*.py")) if path.name not in STORE_FACADE
             and (holders := store_holders(path.read_text(encoding="utf-8")))}
    assert found == {}, f"components that take or keep the TierStore (pass them what they use instead): {found}"
