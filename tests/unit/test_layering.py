"""Import direction and import cycles, read from the source with the stdlib ast.

Layers, bottom to top: the library (shared/), the services (prefill_svc, decode_svc), the
benchmarks (hybridpd_tools/bench), the CLI (hybridpd_tools/cli). Inside the library, floors of
their own, bottom to top: the base (errors, limits, version, timeouts, token_logprobs, cache_root, logs, observe, otel, telemetry),
layout, cache, transport, engine, config, runtime, http, rpc (`LIBRARY_FLOORS`). A module may
import its own layer and the layers below it, never above; the two services never import each
other; scripts/ uses the library only. Every import counts, also one inside a function body or
under TYPE_CHECKING, and the module graph has no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "prefill_svc", "decode_svc", "hybridpd_tools", "scripts")
GENERATED = "shared.pb"

SERVICE, BENCH, CLI, SCRIPTS = "service", "bench", "cli", "scripts"
# The library's floors, bottom to top: a package of shared/ by name, any other module of shared/
# (errors, limits, version, token_logprobs, cache_root, observe, telemetry, logs/, otel/) on the base floor.
LIBRARY_FLOORS = ("base", "layout", "cache", "transport", "engine", "config", "runtime", "http", "rpc")
LIBRARY = "library:"  # each floor's layer is "library:<floor>"
RANK = {**{LIBRARY + f: i for i, f in enumerate(LIBRARY_FLOORS)}, SERVICE: 100, BENCH: 101, CLI: 102}

# Edges allowed to close a cycle for now, each with the reason it still exists; the test below
# fails when one is no longer there, so an entry cannot outlive its reason.
TRANSITIONAL_EDGES: set[tuple[str, str]] = set()

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, packages: Iterable[str]) -> Graph:
    """module -> the modules of the tree it imports (anywhere in its body)."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: Graph = {}
    for name, path in files.items():
        if name == GENERATED or name.startswith(GENERATED + "."):
            continue
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                # `from pkg import sub` imports the module pkg.sub when there is one.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def layer(module: str) -> str:
    top = module.split(".")[0]
    if top in ("prefill_svc", "decode_svc"):
        return SERVICE
    if top == "scripts":
        return SCRIPTS
    if top == "hybridpd_tools":  # its bench/ below its cli/; the package's own __init__ with the top
        return BENCH if module == "hybridpd_tools.bench" or module.startswith("hybridpd_tools.bench.") else CLI
    floor = module.split(".")[1] if module.count(".") else "base"
    return LIBRARY + (floor if floor in LIBRARY_FLOORS else "base")


def violations(graph: Graph) -> list[str]:
    out: list[str] = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if dst == GENERATED or dst.startswith(GENERATED + "."):
                continue
            a, b = layer(src), layer(dst)
            if a == SCRIPTS:
                ok = b.startswith(LIBRARY)
            elif b == SCRIPTS:
                ok = False
            elif a == SERVICE and b == SERVICE:
                ok = src.split(".")[0] == dst.split(".")[0]  # no service imports the other
            else:
                ok = RANK[b] <= RANK[a]
            if not ok:
                out.append(f"{src} ({a}) imports {dst} ({b})")
    return out


def cycles(graph: Graph, allowed: Collection[tuple[str, str]] = ()) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), `allowed` edges left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if (v, w) in allowed:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(ROOT, PACKAGES)


def test_imports_point_down_the_layers(graph: Graph) -> None:
    assert violations(graph) == []


def test_no_import_cycles(graph: Graph) -> None:
    assert cycles(graph, TRANSITIONAL_EDGES) == []


def test_every_transitional_edge_still_exists(graph: Graph) -> None:
    assert [e for e in TRANSITIONAL_EDGES if e[1] not in graph.get(e[0], set())] == []


def test_the_graph_sees_the_tree(graph: Graph) -> None:
    # Known edges, one per kind of import statement: the checks above are not vacuous.
    assert "shared.layout.spec" in graph["shared.layout.presets"]  # from a.b import name
    assert "shared.observe" in graph["prefill_svc.pins"]  # from a import module
    assert "decode_svc.reader" in graph["hybridpd_tools.bench.control"]  # from a.b import name (a service)
    assert "shared.engine.hf.engine" in graph["shared.engine.factory"]  # inside a function body
    assert layer("shared.errors") == layer("shared.logs.setup") == "library:base"
    assert layer("shared.config") == "library:config" and layer("shared.rpc.status") == "library:rpc"
    assert layer("shared.runtime.metrics") == layer("shared.runtime.process") == "library:runtime"  # not gRPC
    assert layer("hybridpd_tools.bench.e2e") == BENCH and layer("hybridpd_tools.cli.main") == layer("hybridpd_tools") == CLI


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_negative_controls_an_upward_import_and_a_cycle_are_reported(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "shared/__init__.py": "",
            "shared/layout/__init__.py": "",
            "shared/layout/a.py": "def f():\n    from shared.layout import b\n",
            "shared/layout/b.py": "import shared.layout.a\n",
            "hybridpd_tools/cli/__init__.py": "",
            "hybridpd_tools/cli/main.py": "",
            "hybridpd_tools/bench/__init__.py": "from hybridpd_tools.cli import main\n",
            "shared/runtime.py": "from decode_svc.app import App\n",
            "shared/cache/__init__.py": "",
            "shared/cache/view.py": "from shared.engine.protocol import Engine\n",
            "shared/engine/__init__.py": "",
            "shared/engine/protocol.py": "from shared.layout import a\n",
            "decode_svc/__init__.py": "",
            "decode_svc/app.py": "from prefill_svc import jobs\n",
            "prefill_svc/__init__.py": "",
            "prefill_svc/jobs.py": "",
        },
    )
    g = import_graph(tmp_path, ("shared", "decode_svc", "prefill_svc", "hybridpd_tools"))
    assert violations(g) == [
        "decode_svc.app (service) imports prefill_svc.jobs (service)",
        "hybridpd_tools.bench (bench) imports hybridpd_tools.cli.main (cli)",
        "shared.cache.view (library:cache) imports shared.engine.protocol (library:engine)",
        "shared.runtime (library:runtime) imports decode_svc.app (service)",
    ]
    assert cycles(g) == [["shared.layout.a", "shared.layout.b"]]
    assert cycles(g, {("shared.layout.a", "shared.layout.b")}) == []
