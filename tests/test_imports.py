"""Dependencies point one way: the services (verifier_service, drafter_service, gateway) never import each
other; what they share lives in `specdec/`. Walks every import statement of every service module (AST, so
imports inside functions count too)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("verifier_service", "drafter_service", "gateway")


def imported_modules(source: str) -> set[str]:
    """Top-level package of every absolute import in `source` (relative imports stay inside the package)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def cross_imports(service: str) -> list[str]:
    """'file: other_service' for every import of another service from `service`."""
    found = []
    for path in sorted((ROOT / service).rglob("*.py")):
        others = imported_modules(path.read_text()) & (set(SERVICES) - {service})
        found += [f"{path.relative_to(ROOT)}: imports {other}" for other in sorted(others)]
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_services_never_import_each_other(service):
    assert (ROOT / service).is_dir()
    assert cross_imports(service) == []


def test_the_walk_sees_every_kind_of_import():
    """The checker itself: a planted cross import in any form is found, a relative one is not."""
    planted = ("import drafter_service.ngram\n"
               "def f():\n    from verifier_service.engine import SpecEngine\n"
               "from .sibling import x\nfrom specdec.drafting import Drafter\n")
    assert imported_modules(planted) == {"drafter_service", "verifier_service", "specdec"}


def test_shared_types_live_in_specdec():
    """The drafter interface and the id pool are importable without either service."""
    source = "\n".join(p.read_text() for p in (ROOT / "specdec" / "drafting").glob("*.py"))
    source += (ROOT / "specdec" / "id_pool.py").read_text()
    assert not imported_modules(source) & set(SERVICES)
