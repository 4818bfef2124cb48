"""Data flows one way: every import of every llmd module (function-level imports included) is
checked against the layer table below, from the source's AST (nothing is imported).

Layers, lowest first; a module may import its own package and what its row allows:

================================  ===========================================================
importer                          may import (llmd packages)
================================  ===========================================================
``llmd.quant``                    nothing else
``llmd.kernels``                  quant
``llmd.models.paths``             nothing else (stdlib only: the cache directory)
``llmd.models``                   kernels, quant
``llmd.daemon.kv``                nothing else (torch-free block bookkeeping)
``llmd.daemon.protocol``          models.paths (a leaf shared with tui: no torch, no aiohttp)
``llmd.daemon.core.errors``       models.errors
``llmd.daemon.core.outputs``      nothing else (plain data)
``llmd.daemon.core``              kv, protocol, models, kernels, quant
``llmd.daemon.serving``           core, kv, protocol, models
``llmd.daemon.client``            protocol, core.errors
``llmd.tui``                      daemon.client, daemon.protocol
``llmd.daemon.bench``             core, kv, serving, client, protocol, models, kernels, quant
``llmd.daemon.cli``               anything (the top, with bench)
================================  ===========================================================

So core never imports serving, client, cli or bench; kernels, quant and models never import the
daemon; the client and tui never import the engine. Third-party imports are checked too: no
aiohttp or click in core, kv or protocol (the engine thread's world), no torch in protocol,
client or tui.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"daemon": "llmd.daemon", "models": "llmd.models", "kernels": "llmd.kernels", "quant": "llmd.quant",
         "tui": "llmd.tui"}

#: importer prefix → the llmd prefixes it may import besides its own package (first match wins)
ALLOWED = [
    ("llmd.quant", []),
    ("llmd.kernels", ["llmd.quant"]),
    ("llmd.models.paths", []),
    ("llmd.models", ["llmd.kernels", "llmd.quant"]),
    ("llmd.daemon.kv", []),
    ("llmd.daemon.protocol", ["llmd.models.paths"]),
    ("llmd.daemon.core.errors", ["llmd.models.errors"]),
    ("llmd.daemon.core.outputs", []),
    ("llmd.daemon.core", ["llmd.daemon.kv", "llmd.daemon.protocol", "llmd.models", "llmd.kernels", "llmd.quant"]),
    ("llmd.daemon.serving", ["llmd.daemon.core", "llmd.daemon.kv", "llmd.daemon.protocol", "llmd.models"]),
    ("llmd.daemon.client", ["llmd.daemon.protocol", "llmd.daemon.core.errors"]),
    ("llmd.tui", ["llmd.daemon.client", "llmd.daemon.protocol"]),
    ("llmd.daemon.bench", ["llmd.daemon.core", "llmd.daemon.kv", "llmd.daemon.serving", "llmd.daemon.client",
                           "llmd.daemon.protocol", "llmd.models", "llmd.kernels", "llmd.quant"]),
    ("llmd.daemon.cli", ["llmd"]),
    ("llmd.daemon", []),  # the package's own __init__
]
#: importer prefix → third-party top-level packages it must not import
FORBIDDEN = [
    ("llmd.daemon.core", ["aiohttp", "click", "textual", "prometheus_client"]),
    ("llmd.daemon.kv", ["aiohttp", "click", "textual", "prometheus_client", "torch"]),
    ("llmd.daemon.protocol", ["aiohttp", "click", "textual", "torch"]),
    ("llmd.daemon.client", ["torch", "textual"]),
    ("llmd.tui", ["torch"]),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [ROOTS[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, at any depth; ``from X import y``
    counts as ``X.y`` when that is a module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else base))
    return out


def rule(table, name):
    return next(v for prefix, v in table if name == prefix or name.startswith(prefix + "."))


def own_package(name: str) -> str:
    """The package whose modules ``name`` may always import: its row's prefix."""
    return next(p for p, _ in ALLOWED if name == p or name.startswith(p + "."))


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = modules()


def test_the_table_covers_every_module():
    assert len(MODULES) > 80
    for name in MODULES:
        rule(ALLOWED, name)  # raises StopIteration when a module has no row


@pytest.mark.parametrize("layer", [p for p, _ in ALLOWED])
def test_no_module_imports_from_a_higher_layer(layer):
    known = set(MODULES)
    bad = []
    for name, path in MODULES.items():
        if own_package(name) != layer:
            continue
        allowed = [layer, *rule(ALLOWED, name)]
        forbidden = next((v for p, v in FORBIDDEN if under(name, p)), [])
        for line, imported in imports_of(name, path, known):
            top = imported.split(".")[0]
            if top == "llmd" and not any(under(imported, a) for a in allowed):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
            elif top in forbidden:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {top}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_function_level_and_relative_imports():
    known = set(MODULES)
    tui_app = imports_of("llmd.tui.app", MODULES["llmd.tui.app"], known)
    assert any(m.startswith("llmd.daemon.client") for _, m in tui_app)  # imported inside a method
    kv = dict((m, line) for line, m in imports_of("llmd.daemon.kv", MODULES["llmd.daemon.kv"], known))
    assert "llmd.daemon.kv.manager" in kv  # ``from .manager import ...``
    assert not any(under(m, "llmd.daemon.serving") for _, m in
                   imports_of("llmd.daemon.core.engine", MODULES["llmd.daemon.core.engine"], known))
