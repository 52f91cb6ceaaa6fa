"""Layers only point down (issue 12, item 2): every module's imports, those inside functions
included, are read with :mod:`ast` and checked against the layer rules below.

    base      sandkernel/*.py (errors, logs, mime, ...): imports no subpackage
    kernels   sandkernel.kernels: base
    notebooks sandkernel.notebooks: kernels, base
    gateway   sandkernel.gateway: notebooks, kernels, base
    agent     sandkernel.agent, sandkernel.integrations: base only (a client library must not pull
              in the server; framework integrations are client code)
    cli       sandkernel.cli, sandkernel.demo, sandkernel.local_gateway, sandkernel.mcp_stdio: anything

Imports under ``if TYPE_CHECKING:`` count too: a type named from a higher layer is still a
dependency pointing up. Each violation is reported as ``file:line imports X (rule)``. The second
test feeds the checker planted violations, so the first cannot pass by checking nothing.
"""

from __future__ import annotations

import ast
import enum
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sandkernel.python_syntax import parse

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sandkernel"


class Layer(enum.Enum):
    BASE = "base"
    KERNELS = "kernels"
    NOTEBOOKS = "notebooks"
    GATEWAY = "gateway"
    AGENT = "agent"
    CLI = "cli"


# What each layer may import from sandkernel (its own layer always included).
ALLOWED: dict[Layer, frozenset[Layer]] = {
    Layer.BASE: frozenset({Layer.BASE}),
    Layer.KERNELS: frozenset({Layer.BASE, Layer.KERNELS}),
    Layer.NOTEBOOKS: frozenset({Layer.BASE, Layer.KERNELS, Layer.NOTEBOOKS}),
    Layer.GATEWAY: frozenset({Layer.BASE, Layer.KERNELS, Layer.NOTEBOOKS, Layer.GATEWAY}),
    Layer.AGENT: frozenset({Layer.BASE, Layer.AGENT}),
    Layer.CLI: frozenset(Layer),
}
SUBPACKAGES = {
    f"{PACKAGE}.kernels": Layer.KERNELS,
    f"{PACKAGE}.notebooks": Layer.NOTEBOOKS,
    f"{PACKAGE}.gateway": Layer.GATEWAY,
    f"{PACKAGE}.agent": Layer.AGENT,
    f"{PACKAGE}.integrations": Layer.AGENT,
}
CLI_MODULES = frozenset(
    {
        f"{PACKAGE}.cli",
        f"{PACKAGE}.cluster_cli",
        f"{PACKAGE}.demo",
        f"{PACKAGE}.local_gateway",
        f"{PACKAGE}.mcp_stdio",
        f"{PACKAGE}.__main__",
    }
)


def layer_of(module: str) -> Layer | None:
    """The layer of a dotted module name; None outside sandkernel."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    for prefix, layer in SUBPACKAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    if any(module == m or module.startswith(m + ".") for m in CLI_MODULES):
        return Layer.CLI
    return Layer.BASE


def rule_text(layer: Layer) -> str:
    allowed = ", ".join(sorted(a.value for a in ALLOWED[layer]))
    return f"{layer.value} may import only {allowed}" if layer is not Layer.CLI else "cli may import anything"


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    target: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target} ({self.rule})"


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted target) for every import in the tree, wherever it sits. Relative imports
    are resolved against ``module``; ``from X import Y`` yields ``X.Y`` (Y may be a submodule:
    the longer name gives the finer layer, and for a name in X it lands in X's layer anyway)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                yield node.lineno, source if alias.name == "*" else f"{source}.{alias.name}"


def check_source(source: str, module: str, file: str, is_package: bool = False) -> list[Violation]:
    """The violations in one module's source (``module`` is its dotted name)."""
    layer = layer_of(module)
    assert layer is not None, module
    found = []
    for line, target in imported_modules(parse(source, filename=file), module, is_package):
        target_layer = layer_of(target)
        if target_layer is not None and target_layer not in ALLOWED[layer]:
            found.append(Violation(file, line, target, rule_text(layer)))
    return found


def package_sources() -> Iterator[tuple[str, Path, bool]]:
    """(dotted name, file, is_package) of every module of sandkernel and its subpackages, found
    where the installed package maps them (pyproject's package-dir), editable or not. Scripts in
    directories that are not packages are not modules of the library and are left out."""
    for name in (PACKAGE, *SUBPACKAGES):
        root = Path(importlib.import_module(name).__path__[0])
        recurse = name != PACKAGE  # sandkernel/ itself: only its own modules, not the mapped dirs
        for path in sorted(root.rglob("*.py") if recurse else root.glob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if not all((root / d / "__init__.py").is_file() for d in rel.parents):
                continue  # a script beside the package (notebooks/examples/record_examples.py)
            parts = [] if rel.name == "__init__" and rel.parent == Path(".") else list(rel.parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
                is_package = True
            else:
                is_package = not parts
            yield ".".join([name, *parts]), path, is_package


def all_violations() -> tuple[list[Violation], int]:
    found, modules = [], 0
    for module, path, is_package in package_sources():
        modules += 1
        try:
            shown = path.relative_to(ROOT).as_posix()
        except ValueError:
            shown = str(path)
        found += check_source(path.read_text(), module, shown, is_package)
    return found, modules


def test_layers_only_point_down():
    violations, modules = all_violations()
    assert modules > 50, f"only {modules} modules found: the walk missed the subpackages"
    for v in violations:
        print(v)
    assert not violations, f"{len(violations)} import(s) point up a layer:\n" + "\n".join(map(str, violations))


PLANTED = """
from __future__ import annotations
import json
from typing import TYPE_CHECKING
from sandkernel.errors import SandkernelError
from . import outputs
if TYPE_CHECKING:
    from sandkernel.agent.client import Client
def later():
    import sandkernel.gateway.server as server
    from ...notebooks import recorder
    from sandkernel import cli
    return server, recorder, cli
"""


def test_the_rules_catch_planted_violations():
    """A kernels/ module importing up (at top level, under TYPE_CHECKING, inside a function,
    absolutely and relatively) is caught line by line; its legal imports are not."""
    found = check_source(PLANTED, "sandkernel.kernels.execution.planted", "kernels/execution/planted.py")
    assert [(v.line, v.target) for v in found] == [
        (8, "sandkernel.agent.client.Client"),
        (10, "sandkernel.gateway.server"),
        (11, "sandkernel.notebooks.recorder"),
        (12, "sandkernel.cli"),
    ], found
    assert str(found[0]) == (
        "kernels/execution/planted.py:8 imports sandkernel.agent.client.Client (kernels may import only base, kernels)"
    )
    # The same source is legal in the CLI layer, and the agent may not import kernels/ either.
    assert check_source(PLANTED, "sandkernel.demo", "sandkernel/demo.py") == []
    agent = check_source("from sandkernel.kernels.execution import outputs\n", "sandkernel.agent.x", "agent/x.py")
    assert [v.target for v in agent] == ["sandkernel.kernels.execution.outputs"]
    base = check_source("def f():\n    from .gateway import budget\n", "sandkernel.mime", "sandkernel/mime.py")
    assert [v.target for v in base] == ["sandkernel.gateway.budget"]


def test_the_cli_skips_the_slow_unused_import_and_notebooks_still_validate():
    """sandkernel/imports.py: the CLI's processes never compile rfc3987_syntax's grammar (seconds
    of CPU per gateway start), and what imports jsonschema without it still works: nbformat
    validates a notebook, and jsonschema validates the way the MCP SDK calls it."""
    import subprocess
    import sys

    probe = (
        "from sandkernel.imports import skip_unused_slow_imports\n"
        "skip_unused_slow_imports()\n"
        "import jsonschema, nbformat\n"
        "nbformat.validate(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('1')]))\n"
        "jsonschema.validate({'code': 'x'}, {'type': 'object', 'properties': {'code': {'type': 'string'}}})\n"
        "try:\n    import rfc3987_syntax\nexcept ImportError:\n    print('skipped')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "skipped", done.stdout + done.stderr
    main = (ROOT / "sandkernel" / "cli.py").read_text().split("def main(", 1)[1]
    assert "skip_unused_slow_imports()" in main.split("args = ", 1)[0], "main() must skip before any command runs"


# -- no import cycle among the modules (issue 32) ---------------------------------------------
#
# Layers say which way packages point; inside a layer, modules must form a directed graph too:
# a cycle makes the order of module loading decide what works, and hides two modules that are
# one. Counted: the imports that run when a module loads and those under ``if TYPE_CHECKING:``
# (a type named from a module that imports this one is still a cycle, only one the interpreter
# does not trip on). Imports inside functions are not counted: they run at call time.


def load_time_imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[str]:
    """The dotted targets of ``tree``'s imports outside functions (module level, class bodies,
    ``if``/``try`` blocks, ``if TYPE_CHECKING:`` included)."""

    def visit(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            yield node
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from visit([c for c in children if isinstance(c, ast.stmt | ast.ExceptHandler)])

    top = ast.Module(body=list(visit(tree.body)), type_ignores=[])
    shallow = ast.Module(body=[n for n in top.body if isinstance(n, ast.Import | ast.ImportFrom)], type_ignores=[])
    for _, target in imported_modules(shallow, module, is_package):
        yield target


def module_graph(sources: Iterator[tuple[str, str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of the same graph it imports at load time. ``sources`` are
    (dotted name, source, is_package); ``from X import Y`` counts as X.Y where that is a module
    of the graph, else as X (the longest module the name lies in)."""
    parsed = {name: (parse(source), is_package) for name, source, is_package in sources}
    graph: dict[str, set[str]] = {}
    for name, (tree, is_package) in parsed.items():
        graph[name] = set()
        for target in load_time_imports(tree, name, is_package):
            while target and target not in parsed:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                strong(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return sorted(found)


def test_no_import_cycle_among_the_modules():
    graph = module_graph((name, path.read_text(), is_package) for name, path, is_package in package_sources())
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the walk missed modules or imports"
    found = cycles(graph)
    described = [
        " <-> ".join(cycle)
        + "\n    "
        + "\n    ".join(f"{m} imports {', '.join(sorted(graph[m] & set(cycle)))}" for m in cycle)
        for cycle in found
    ]
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(described)


def test_the_cycle_check_finds_planted_cycles_and_spares_function_imports():
    """A cycle through a TYPE_CHECKING import is found, one closed only inside a function is
    not, and a three-module ring is one component."""
    sources = [
        ("pkg", "", True),
        ("pkg.a", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n", False),
        ("pkg.b", "from pkg import a\n", False),
        ("pkg.c", "def later():\n    from pkg import d\n", False),
        ("pkg.d", "from pkg.c import later\n", False),
        ("pkg.x", "from . import y\n", False),
        ("pkg.y", "import pkg.z\n", False),
        ("pkg.z", "class Z:\n    from pkg.x import X\n", False),
    ]
    assert cycles(module_graph(iter(sources))) == [["pkg.a", "pkg.b"], ["pkg.x", "pkg.y", "pkg.z"]]


# -- sub-packages (issue 32, item 3) -------------------------------------------------------------
# Inside sandkernel.kernels the sub-packages form a directed graph too: model (profiles, records)
# and egress at the bottom, sandbox above them, durable (the catalogs) and execution above that,
# lifecycle (pool, prewarm, reaper, profile catalog) above execution. A module's imports of another
# sub-package's modules are edges between the two sub-packages; no cycle among them.
DAG_PACKAGES = (f"{PACKAGE}.kernels",)


def subpackage_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """sub-package -> the sub-packages of ``package`` its modules import (its top-level modules
    are the sub-package ``(top)``)."""

    def part(module: str) -> str | None:
        if not module.startswith(package + "."):
            return None
        rest = module[len(package) + 1 :].split(".")
        return rest[0] if len(rest) > 1 or f"{package}.{rest[0]}" in subpackages else "(top)"

    subpackages = {m for m in graph if m.startswith(package + ".") and any(o.startswith(m + ".") for o in graph)}
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = part(module)
        if source is None:
            continue
        edges.setdefault(source, set())
        for target in targets:
            sink = part(target)
            if sink is not None and sink != source:
                edges[source].add(sink)
                edges.setdefault(sink, set())
    return edges


def test_the_sub_packages_form_a_directed_graph():
    graph = module_graph((name, path.read_text(), is_package) for name, path, is_package in package_sources())
    for package in DAG_PACKAGES:
        edges = subpackage_graph(graph, package)
        assert len(edges) >= 5, f"the walk missed {package}'s sub-packages: {sorted(edges)}"
        found = cycles(edges)
        described = [
            " <-> ".join(cycle)
            + "\n    "
            + "\n    ".join(
                f"{module} imports {target}"
                for module, targets in sorted(graph.items())
                for target in sorted(targets)
                for cycle_part in [cycle]
                if any(module.startswith(f"{package}.{a}.") for a in cycle_part)
                and any(target.startswith(f"{package}.{b}.") for b in cycle_part)
                and module.split(".")[2] != target.split(".")[2]
            )
            for cycle in found
        ]
        assert not found, f"{package}: sub-package cycle(s):\n" + "\n".join(described)


def test_the_sub_package_check_finds_a_planted_cycle():
    sources = [
        ("pkg", "", True),
        ("pkg.low", "", True),
        ("pkg.low.a", "from pkg.high.b import B\n", False),
        ("pkg.high", "", True),
        ("pkg.high.b", "B = 1\n", False),
        ("pkg.high.c", "from pkg.low.a import x\n", False),
        ("pkg.tool", "from pkg.low import a\n", False),
    ]
    edges = subpackage_graph(module_graph(iter(sources)), "pkg")
    assert edges == {"low": {"high"}, "high": {"low"}, "(top)": {"low"}}
    assert cycles(edges) == [["high", "low"]]


# -- the cluster on top of one host (issue 32, item 2) --------------------------------------------
# The single-host gateway imports nothing of gateway/cluster, wherever the import sits (function
# bodies and TYPE_CHECKING included): it names what it asks of the cluster by protocols (base.py's
# Router, channels.py's WebsocketRouter, registry.py's Cluster). server.py, which builds a gateway
# and its cluster when it is one of several, is the one module that joins them.
CLUSTER = f"{PACKAGE}.gateway.cluster"
JOINS_THE_CLUSTER = frozenset({f"{PACKAGE}.gateway.server"})


def cluster_imports_of_the_core(sources: Iterator[tuple[str, str, bool]]) -> list[str]:
    found = []
    for module, source, is_package in sources:
        if not module.startswith(f"{PACKAGE}.gateway") or module.startswith(CLUSTER) or module in JOINS_THE_CLUSTER:
            continue
        for line, target in imported_modules(parse(source), module, is_package):
            if target == CLUSTER or target.startswith(CLUSTER + "."):
                found.append(f"{module}:{line} imports {target}")
    return found


def test_the_single_host_gateway_imports_nothing_of_the_cluster():
    sources = ((name, path.read_text(), is_package) for name, path, is_package in package_sources())
    assert cluster_imports_of_the_core(sources) == []


def test_the_cluster_import_check_finds_a_planted_import():
    sources = [
        (f"{PACKAGE}.gateway.handlers", "def later():\n    from sandkernel.gateway.cluster import forward\n", False),
        (f"{PACKAGE}.gateway.cluster.router", "from sandkernel.gateway.base import Router\n", False),
        (f"{PACKAGE}.gateway.server", "from sandkernel.gateway.cluster.router import ClusterRouter\n", False),
    ]
    assert cluster_imports_of_the_core(iter(sources)) == [
        f"{PACKAGE}.gateway.handlers:2 imports {PACKAGE}.gateway.cluster.forward"
    ]
