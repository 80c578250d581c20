"""The layers of dsq (the library) and dsq_cli (the suite) (docs/architecture.md) as a test: the
import graph, function-level imports included, has no cycle, and no module imports a layer above
its own. The suite sits above the library: dsq_cli imports dsq, never the other way."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from helpers.imports import SUITE_PACKAGES, loaded_after

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (REPO / "dsq_cli", REPO / "dsq")

# Each layer may import its own modules and those of the layers after it, never one before it.
LAYERS = [
    # the suite
    ("cli", ["dsq_cli.cli", "dsq_cli.__main__"]),
    ("studies", ["dsq_cli.sweep"]),
    ("train", ["dsq_cli.train"]),
    ("reporting", ["dsq_cli.table", "dsq_cli.plots", "dsq_cli.bench", "dsq_cli.loggers"]),
    ("config", ["dsq_cli.config"]),
    ("data and models", ["dsq_cli.data", "dsq_cli.models"]),
    ("cost", ["dsq_cli.cost"]),
    (
        "files",
        [
            "dsq_cli.run_config",
            "dsq_cli.presets",
            "dsq_cli.run_result",
            "dsq_cli.runs",
            "dsq_cli.cpu_allocator",
        ],
    ),  # fmt: skip
    ("suite root", ["dsq_cli"]),
    # the library
    ("library api", ["dsq"]),
    ("integrations", ["dsq.integrations"]),
    ("library cost", ["dsq.cost"]),  # the cost model's pure part: no file, no preset
    # the engine and the named specs it builds configs from (QuantConfig.from_preset); the
    # presets import the spec and the policies, not the config: the graph has no cycle
    ("engine", ["dsq.engine", "dsq.presets"]),
    ("formats", ["dsq.formats"]),
    ("kernels", ["dsq.kernels"]),
    ("atomic files", ["dsq.atomic_files"]),  # the standard library only
    ("records", ["dsq.records"]),  # the standard library only
    ("warnings", ["dsq.warn_once"]),  # the standard library only
]
# Inside train/: the launcher and the rank helpers import nothing above them.
LEAVES = {
    "dsq_cli.train.ranks": set(),
    "dsq_cli.train.launch": {"dsq_cli.train.ranks"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # one parse of the tree for the whole module's tests
def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted(package.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The dsq_cli modules ``path`` imports anywhere in its body (function-level too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import module` imports the module (pkg is already being imported);
            # `from module import name` imports the module
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in ("dsq", "dsq_cli") and target != name:
                found.add(target)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (annotations, never executed)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                pending.extend(child.orelse)
                continue
            pending.append(child)


@functools.cache
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best[0]


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    # The check itself: a function-level import that closes a loop is a cycle.
    (tmp_path / "a.py").write_text("from dsq_cli import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from dsq_cli import a\n")
    known = {"dsq_cli.a", "dsq_cli.b"}
    edges = {
        "dsq_cli.a": imports_of("dsq_cli.a", tmp_path / "a.py", known),
        "dsq_cli.b": imports_of("dsq_cli.b", tmp_path / "b.py", known),
    }
    assert cycles(edges) == [["dsq_cli.a", "dsq_cli.b"]]


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_module_imports_a_layer_above_its_own(module):
    edges = graph()
    mine = layer_of(module)
    upward = sorted(t for t in edges[module] if layer_of(t) < mine)
    assert upward == [], f"{module} ({LAYERS[mine][0]}) imports {upward}"


@pytest.mark.parametrize("module, allowed", sorted(LEAVES.items()))
def test_the_launcher_and_rank_helpers_import_nothing_above_them(module, allowed):
    assert graph()[module] <= allowed


# The kernels sit below formats: the formats layer is their host glue, and the benchmarks time
# them beside it. The engine and everything above reach them only through formats. The one
# other user is the CPU allocator setting, which installs the block cache (not a numeric
# kernel: a C++ library built by the kernels' machinery) for `DSQ_CPU_ALLOCATOR=reuse`.
KERNEL_USERS = ("dsq.formats", "dsq.kernels", "dsq_cli.bench", "dsq_cli.cpu_allocator")


def kernel_imports(path: Path) -> bool:
    """Whether ``path`` imports dsq.kernels anywhere in its body (function-level too)."""
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(
            a.name.startswith("dsq.kernels") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsq.kernels"):
            return True
    return False


def test_only_formats_and_the_benchmarks_import_the_kernels():
    users = sorted(name for name, path in modules().items() if kernel_imports(path))
    assert users and all(u.startswith(KERNEL_USERS) for u in users), users


def test_the_kernel_import_finder_sees_a_lazy_import(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from dsq.kernels import onednn\n")
    assert kernel_imports(tmp_path / "a.py")


@pytest.mark.slow  # spawns processes
def test_the_library_loads_no_module_of_the_suite_or_its_frameworks():
    # what a user of the library imports pulls in nothing they did not ask for
    assert loaded_after("import dsq, dsq.engine, dsq.formats, dsq.integrations") == []
    # the presets are the library's: no conf/quant/*.yaml read (no yaml)
    preset = "import dsq; dsq.QuantConfig.from_preset('dsq'); dsq.presets.get_preset('fp32')"
    assert loaded_after(preset, (*SUITE_PACKAGES, "yaml")) == []
    # the cost model prices a step with its built-in coefficients: no conf/cost/*.yaml (no yaml)
    step = "[c.GemmRecord('linear', 1, 4, 8, 8, (), 0)]"
    priced = f"import dsq.cost as c; c.ratios({step}, c.FIXED32); c.step_cost({step}, c.FIXED32)"
    assert loaded_after(priced, (*SUITE_PACKAGES, "yaml")) == []
    pytest.importorskip("transformers")
    assert loaded_after("import dsq, dsq.engine, dsq.integrations.hf") == ["transformers"]


# Inside table/: each module imports only those before it here (dsq_cli/table/__init__.py).
TABLE_ORDER = ("intervals", "cells", "collect", "text", "comparisons", "post_move", "records",
               "moves", "frontier", "render", "wandb_log")  # fmt: skip


def test_the_table_packages_modules_import_only_those_before_them():
    folder = REPO / "dsq_cli" / "table"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(TABLE_ORDER)
    for position, name in enumerate(TABLE_ORDER):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {node.module.split(".")[-1] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 1}  # fmt: skip
        imported |= {node.module.split(".")[2] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module
                     and node.module.startswith("dsq_cli.table.")}  # fmt: skip
        later = imported - set(TABLE_ORDER[:position])
        assert not later, f"table/{name}.py imports {sorted(later)}, which come after it"


def test_the_readmes_layout_names_every_script():
    """The README's layout lists scripts/ by name: a new script is named there, not found later."""
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("scripts/ ") : readme.index("tests/ ")]
    unnamed = [p.name for p in (REPO / "scripts").iterdir()
               if p.is_file() and p.stem not in layout]  # fmt: skip
    assert unnamed == [], f"README.md's layout does not name scripts/{unnamed}"
