"""The scripts in benchmarks/ are not run by the suite (they measure for minutes), but they must still start and
use cbgen as it is: each answers --help, and every name any of them imports from cbgen exists. Most import cbgen
only once their arguments are parsed, or inside code they hand to a child process, so --help alone proves nothing:
the names are read from the scripts' source, child code included, and looked up."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def cbgen_imports(source: str) -> set[tuple[str, str | None]]:
    """(module, name) for every import from cbgen in `source`, at any depth, and in any string constant that is
    Python code importing from cbgen (what a script runs in a child process); name None for `import cbgen.x`."""
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cbgen":
            found.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update((alias.name, None) for alias in node.names if alias.name.split(".")[0] == "cbgen")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "cbgen" in node.value:
            try:
                found |= cbgen_imports(node.value)
            except SyntaxError:
                pass  # a message or a path, not code
    return found


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_starts(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "cbgen" in s.read_text()], ids=lambda p: p.name)
def test_every_name_a_script_imports_from_cbgen_exists(script):
    imports = cbgen_imports(script.read_text(encoding="utf-8"))
    assert imports, f"{script.name} mentions cbgen but imports nothing from it"
    missing = []
    for module, name in sorted(imports, key=str):
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module} ({e})")
            continue
        if name is not None and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports what cbgen no longer has: {missing}"


def test_the_check_reads_child_code_and_late_imports():
    source = '''
def main():
    from cbgen.job.run import run_job
CHILD = """
from cbgen.nowhere import thing
print(thing)
"""
'''
    assert cbgen_imports(source) == {("cbgen.job.run", "run_job"), ("cbgen.nowhere", "thing")}
