"""The house rules the tree keeps: no import cycles between cbgen's modules (a package's `__init__` counted as the
module it is) nor between its packages, no module over ~400 lines and no function over ~60 without a reason written
here."""

from __future__ import annotations

import ast
from pathlib import Path

import cbgen

ROOT = Path(cbgen.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# function -> why it may be longer
LONG_FUNCTIONS = {
    "cbgen.cli.bench_cmd.bench": "typer declares each of its 13 options in the signature",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def ancestors(name: str) -> list[str]:
    """The packages whose `__init__` runs before module `name` can: cbgen.a.b.c -> cbgen, cbgen.a, cbgen.a.b."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def runtime_imports(path: Path, importer: str | None = None) -> set[str]:
    """The cbgen modules a module imports, at the top or inside functions; `if TYPE_CHECKING:` blocks, which never
    run, are left out. Importing cbgen.x.y also runs cbgen/x/__init__.py, so the packages above an imported module
    count too, except those above the importer itself (already imported by the time it runs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("cbgen"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cbgen"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    running = set(ancestors(importer)) | {importer} if importer else set()
    found |= {package for name in found for package in ancestors(name)}
    return {name for name in found if name in MODULES and name not in running}


def import_graph() -> dict[str, set[str]]:
    return {name: runtime_imports(path, name) - {name} for name, path in MODULES.items()}


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [name, target]) if target in path
                              else f"{name} -> {target}")
            elif target not in state:
                visit(target, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_modules_stay_small():
    big = {name: n for name, path in MODULES.items()
           if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {big}"


def test_functions_stay_short():
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{name}.{node.name}" not in LONG_FUNCTIONS:
                    long[f"{name}.{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long} (split them, or say why in LONG_FUNCTIONS)"


def package_of(name: str) -> str:
    """The part of the tree a module belongs to: its top-level package (cbgen.engine), or itself (cbgen.job.run)."""
    return ".".join(name.split(".")[:2])


def test_no_packages_depend_on_each_other():
    """Packages form layers: when one uses another, the other never uses it back."""
    uses: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        for target in targets:
            if package_of(name) != package_of(target):
                uses.setdefault(package_of(name), set()).add(package_of(target))
    mutual = sorted(f"{a} <-> {b}" for a, targets in uses.items() for b in targets if a < b and a in uses.get(b, ()))
    assert not mutual, f"packages that import each other: {mutual}"


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    """The check itself: an import inside a function counts (the cycles this tree once had were such imports)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from cbgen.job.run import run_job\n\nif TYPE_CHECKING:\n    import cbgen.engine\n")
    assert runtime_imports(module) == {"cbgen", "cbgen.job", "cbgen.job.run"}


def test_the_cycle_check_counts_the_packages_above_an_import(tmp_path):
    """Importing cbgen.engine.setup runs cbgen/engine/__init__.py first: an edge to that package, except from a
    module inside it (which the package itself imports, or which only runs once the package has)."""
    module = tmp_path / "m.py"
    module.write_text("from cbgen.engine.setup import plan_engine\n")
    assert runtime_imports(module, "cbgen.job.run") == {"cbgen.engine", "cbgen.engine.setup"}
    assert runtime_imports(module, "cbgen.engine.engine") == {"cbgen.engine.setup"}


def kind_comparisons(path: Path) -> list[str]:
    """The places in a module that tell a stage kind by its name: a comparison (==, !=, in) of a kind's name
    (cbgen.kinds.KINDS) with anything."""
    from cbgen.kinds import KINDS

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        parts += [e for part in parts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) for e in part.elts]
        names = [part.value for part in parts
                 if isinstance(part, ast.Constant) and isinstance(part.value, str) and part.value in KINDS]
        if names:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_kinds_are_told_apart_only_in_their_registry():
    """What a kind is lives in cbgen.kinds, one module a kind: everything else asks the kind (cbgen.kinds.base),
    never compares its name, so that a new kind is one new module and one registry line."""
    found = {name: lines for name, path in MODULES.items()
             if not name.startswith("cbgen.kinds") and (lines := kind_comparisons(path))}
    assert not found, f"kind names compared outside cbgen.kinds: {found}"


def test_the_kind_check_sees_comparisons(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("if job.kind == 'score':\n    pass\nok = kind in ('generate', 'sql')\n"
                      "fine = {'score': 1}['score'] is None\n")
    assert [line.split(":")[0] for line in kind_comparisons(module)] == ["line 1", "line 3"]
