"""The package's shape, checked from its source (ast, nothing imported):

* no import cycle among the imports a module runs when it is imported (module level, outside
  ``if TYPE_CHECKING:``); a cycle there makes the import order matter and a module half-built
  when the other reads it;
* the client-session modules of the server import nothing of ``server/app.py`` (not even for
  annotations): they depend on ``server/session_host.SessionHost`` only;
* the server and the cluster call an engine through ``EngineAPI`` only: no ``getattr(`` whose
  object is an engine (``engine``, ``self.engine``, ``server.engine``);
* ``runtime/`` imports nothing of ``bench/``, at module level (annotations included) or inside a
  function: the benchmarks drive the engine, not the other way round;
* the engine reads no switch itself (issue 44, "One wiring"): ``runtime/engine.py`` reads no
  section or key of the deploy config (``deploy.engine.tick_seconds``, ``self.deploy.stage0``);
  it hands ``deploy`` whole to the builders (``runtime/engine_parts.py``) that make its parts;
* the sizes issue 44 set: ``runtime/engine.py`` at most 400 lines, no module over 600 outside
  ``models/`` (one readable file per model may be longer), ``bench/`` under 6.2k lines and
  docs/benchmarks.md at most 500 (the current tables; history goes to docs/results/).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "duplexcache"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], annotations: bool) -> list[ast.stmt]:
    """Import statements run at import time (module level, into if/try blocks); with
    ``annotations`` also those under ``if TYPE_CHECKING:``."""
    out = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if _is_type_checking(node) and not annotations:
                continue
            out += _import_nodes(node.body, annotations) + _import_nodes(node.orelse, annotations)
        elif isinstance(node, ast.Try):
            out += _import_nodes(node.body + node.orelse + node.finalbody, annotations)
            for handler in node.handlers:
                out += _import_nodes(handler.body, annotations)
    return out


def _imports(name: str, path: Path, mods: dict[str, Path], annotations: bool = False) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text()).body, annotations):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        for alias in node.names:   # `from pkg import module` names a module; else the name is in base
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
    return {m for m in found if m in mods and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
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
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert graph["duplexcache.server.app"] >= {"duplexcache.server.realtime_session"}   # the walk sees imports
    assert _cycles(graph) == []


@pytest.mark.parametrize("module", ["realtime_session", "minicpmo_session", "session_host"])
def test_client_sessions_do_not_import_the_server(module):
    mods = _modules()
    name = f"duplexcache.server.{module}"
    assert "duplexcache.server.app" not in _imports(name, mods[name], mods, annotations=True)


def test_runtime_imports_nothing_of_the_benchmarks():
    mods = _modules()
    bench = {name: sorted(m for m in _imports(name, path, mods, annotations=True) if m.startswith("duplexcache.bench"))
             for name, path in mods.items() if name.startswith("duplexcache.runtime")}
    assert {name: found for name, found in bench.items() if found} == {}
    # nor inside a function (a lazy import is still the engine depending on the benchmarks)
    lazy = {name: [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("duplexcache.bench")]
            for name, path in mods.items() if name.startswith("duplexcache.runtime")}
    assert {name: lines for name, lines in lazy.items() if lines} == {}
    target = "duplexcache.bench.engine_target"   # the walk sees an import of bench/ where there is one
    assert "duplexcache.bench.fast_forward" in _imports(target, mods[target], mods)


def _is_engine(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


@pytest.mark.parametrize("package", ["server", "cluster"])
def test_no_getattr_on_an_engine(package):
    probes = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and _is_engine(node.args[0])):
                probes.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert probes == []


def test_the_engine_probe_check_can_fail():
    call = ast.parse('getattr(self.engine, "late_ticks", 0)').body[0].value
    assert isinstance(call, ast.Call) and _is_engine(call.args[0])


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_sizes_a_newcomer_can_read():
    assert _lines(PACKAGE / "runtime" / "engine.py") <= 400
    long = {str(p.relative_to(PACKAGE)): _lines(p) for p in PACKAGE.rglob("*.py")
            if "models" not in p.relative_to(PACKAGE).parts and _lines(p) > 600}
    assert not long, long
    assert sum(_lines(p) for p in (PACKAGE / "bench").rglob("*.py")) < 6200
    assert _lines(PACKAGE.parent / "docs" / "benchmarks.md") <= 500


def _is_deploy(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "deploy") or (
        isinstance(node, ast.Attribute) and node.attr == "deploy" and isinstance(node.value, ast.Name)
        and node.value.id == "self")


def _deploy_reads(source: str) -> list[str]:
    """``deploy.<section>[.<key>]`` and ``self.deploy.<section>[.<key>]`` in ``source`` (a section
    read counts: ``e = deploy.engine`` then ``e.tick_seconds`` reads a switch all the same)."""
    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_deploy(node.value):
            reads.append((node.lineno, ast.unparse(node)))
    return [f"{text}:{line}" for line, text in sorted(reads)]


def test_the_engine_reads_no_switch_itself():
    assert _deploy_reads((PACKAGE / "runtime" / "engine.py").read_text()) == []


def test_the_switch_read_check_can_fail():
    source = "x = self.deploy.engine.prefill_chunk_tokens\ne = deploy.engine\nf(deploy, self.deploy)\n"
    assert _deploy_reads(source) == ["self.deploy.engine:1", "deploy.engine:2"]
