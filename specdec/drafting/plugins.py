"""Drafter plugins: a drafter kind can come from any installed package through the entry point group
`specdec.drafters`, with no change to this repository. In the plugin's pyproject.toml:

    [project.entry-points."specdec.drafters"]
    echo = "my_package.echo:build"      # build(options: DrafterOptions) -> Drafter

`specdec drafter --kind echo` then finds it, and the verifier treats it like a built-in kind.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Callable

from .interface import Drafter, DrafterOptions

ENTRY_POINT_GROUP = "specdec.drafters"
DrafterFactory = Callable[[DrafterOptions], Drafter]


def plugin_entry_points() -> dict[str, EntryPoint]:
    """Installed plugin kinds by name (the entry point's name is the kind)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_plugin(kind: str) -> DrafterFactory:
    points = plugin_entry_points()
    if kind not in points:
        raise ValueError(f"no drafter plugin named {kind!r} (entry point group {ENTRY_POINT_GROUP!r}; "
                         f"installed: {', '.join(sorted(points)) or 'none'})")
    factory = points[kind].load()
    if not callable(factory):
        raise ValueError(f"drafter plugin {kind!r} ({points[kind].value}) is not callable: it must be "
                         "a factory taking DrafterOptions and returning a Drafter")
    return factory
