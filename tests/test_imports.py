"""Dependencies point one way: kernels ← specdec (the shared core) ← the services (verifier_service, drafter_service,
gateway, which never import each other) ← specdec_tools (CLI, local stack, bench, training). Walks every import
statement of every module of every package (AST, so imports inside functions count too). The one exception is
`specdec/__main__.py`, the process entry point of `python -m specdec`, which nothing imports."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("verifier_service", "drafter_service", "gateway")
LAYER = {"kernels": 0, "specdec": 1, **{s: 2 for s in SERVICES}, "specdec_tools": 3}
ENTRY_POINTS = {Path("specdec/__main__.py")}


def imported_modules(source: str) -> set[str]:
    """Top-level package of every absolute import in `source` (relative imports stay inside the package)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def upward_imports(package: str) -> list[str]:
    """'file: imports other' for every import of a package in the same layer or above `package`'s."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.relative_to(ROOT) in ENTRY_POINTS:
            continue
        others = {m for m in imported_modules(path.read_text()) & set(LAYER)
                  if m != package and LAYER[m] >= LAYER[package]}
        found += [f"{path.relative_to(ROOT)}: imports {other}" for other in sorted(others)]
    return found


@pytest.mark.parametrize("package", sorted(LAYER))
def test_imports_point_down_the_layers(package):
    assert (ROOT / package).is_dir()
    assert upward_imports(package) == []


def test_every_package_is_in_a_layer():
    """A new top-level package must be given a layer here (else nothing would check it)."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests"} == set(LAYER)


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The checker itself: a planted cross import in any form is found, a relative one is not, and a core module
    that imports a service or a tool is caught."""
    planted = ("import drafter_service.ngram\n"
               "def f():\n    from verifier_service.engine import SpecEngine\n"
               "from .sibling import x\nfrom specdec.drafting import Drafter\n")
    assert imported_modules(planted) == {"drafter_service", "verifier_service", "specdec"}
    (tmp_path / "specdec").mkdir()
    (tmp_path / "specdec" / "bad.py").write_text("def f():\n    import specdec_tools.cli\nimport gateway.wire\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert upward_imports("specdec") == ["specdec/bad.py: imports gateway", "specdec/bad.py: imports specdec_tools"]


def test_shared_types_live_in_specdec():
    """The drafter interface and the id pool are importable without either service."""
    source = "\n".join(p.read_text() for p in (ROOT / "specdec" / "drafting").glob("*.py"))
    source += (ROOT / "specdec" / "id_pool.py").read_text()
    assert not imported_modules(source) & set(SERVICES)
