"""The package's shape, read from its source with `ast` (docs/architecture.md): no import
cycles, dependencies in one direction, and an orchestration that names no method and no family."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import rope_ext
from rope_ext import method as methods
from rope_ext.patches import ADAPTERS

ROOT = Path(__file__).resolve().parents[2]
# installed name -> folder (pyproject.toml's package-dir)
FOLDERS = {"rope_ext": ROOT / "rope_ext", "rope_ext.patches": ROOT / "patches", "rope_ext.evals": ROOT / "evals"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported rope_ext module, whether the import sits inside a function) for each import."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inside = {
        id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES:
                found.append((target, id(node) in inside))
    return found


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def test_no_import_cycle():
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target, _ in GRAPH[name]:
            if state.get(target) == "open":
                cycle = trail[trail.index(target) :] + [target] if target in trail else [name, target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in GRAPH:
        if name not in state:
            visit(name, [name])


# The package root: the core alone (and the router, rope_ext.cli); every other floor has its folder.
CORE = (
    "catalog",
    "chunked",
    "defaults",
    "extras",
    "geometry",
    "loading",
    "names",
    "patching",
    "record",
    "rotary",
    "rotation",
    "saving",
    "serving",
    "shipped",
)
# What a command's module may import at its top: modules that import no torch when they load
# (tests/cli/test_cli.py runs every --help and checks it).
TORCH_FREE = (
    "rope_ext",
    "rope_ext.catalog",
    "rope_ext.defaults",
    "rope_ext.extras",
    "rope_ext.names",
    "rope_ext.loading",
    "rope_ext.evals",
    "rope_ext.evals.data",
    "rope_ext.evals.output",
    "rope_ext.evals.retrieval",
)
# The commands and what a command runs: their modules import ours when they run, so that `--help`
# starts without torch and a figure's optional matplotlib loads only to draw it.
COMMANDS = ("rope_ext.cli", "rope_ext.commands", "rope_ext.evals", "rope_ext.tuning.search")
# What the commands' parsers read before torch loads: it imports the registry, the record and
# patching in the functions that use them.
READ_BY_PARSERS = ("rope_ext.loading",)


def within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_core_imports_its_own_modules_at_the_top():
    """Below the command line, an import of our own module inside a function would only be there
    to dodge a cycle."""
    core = [n for n in GRAPH if not within(n, COMMANDS + READ_BY_PARSERS)]
    late = [(n, t) for n in core for t, inside in GRAPH[n] if inside]
    assert late == []


def test_nothing_below_the_commands_imports_them():
    """The core, the evals, the writers (rope_ext.export), the tuning, training and the study import
    no command module and not the router."""
    wrong = [
        (n, t)
        for n in GRAPH
        if not within(n, ("rope_ext.cli", "rope_ext.commands"))
        for t, _ in GRAPH[n]
        if within(t, ("rope_ext.cli", "rope_ext.commands"))
    ]
    assert wrong == []


def test_the_package_root_holds_the_core_and_a_folder_per_floor():
    """The root's modules are the core (and the router); the commands, the evals, the writers, the
    tuning, training and the study each have their folder."""
    root = sorted(p.stem for p in (ROOT / "rope_ext").glob("*.py") if p.stem != "__init__")
    assert root == sorted(CORE + ("cli",))


def test_every_help_reads_only_torch_free_modules():
    """A command's module imports at its top only the modules whose own top imports no torch, so that
    every `--help` answers at once (tests/cli checks it by running each)."""
    for name in GRAPH:
        if within(name, ("rope_ext.commands",)):
            top = {t for t, inside in GRAPH[name] if not inside}
            assert all(t in TORCH_FREE or within(t, ("rope_ext.commands",)) for t in top), (name, top)


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        (
            "rope_ext.method",
            ("rope_ext.patches", "rope_ext.patching", "rope_ext.saving", "rope_ext.record", "rope_ext.evals", "rope_ext.cli"),
        ),
        ("rope_ext.patches", ("rope_ext.patching", "rope_ext.saving", "rope_ext.evals", "rope_ext.cli", "rope_ext.training")),
        ("rope_ext.patching", ("rope_ext.evals", "rope_ext.cli", "rope_ext.saving", "rope_ext.loading")),
        ("rope_ext.loading", ("rope_ext.evals", "rope_ext.export", "rope_ext.tuning", "rope_ext.training")),
        ("rope_ext.evals", ("rope_ext.export", "rope_ext.tuning", "rope_ext.training", "rope_ext.study")),
        ("rope_ext.export", ("rope_ext.evals", "rope_ext.tuning", "rope_ext.training", "rope_ext.study")),
        ("rope_ext.tuning", ("rope_ext.export", "rope_ext.training", "rope_ext.study")),
        ("rope_ext.training", ("rope_ext.export", "rope_ext.tuning", "rope_ext.study")),
    ],
)
def test_dependencies_run_one_way(layer, forbidden):
    wrong = [
        (n, t)
        for n in GRAPH
        if n == layer or n.startswith(layer + ".")
        for t, _ in GRAPH[n]
        if any(t == f or t.startswith(f + ".") for f in forbidden) and not t.startswith(layer)
    ]
    assert wrong == []


# What a method module may import of ours (docs/architecture.md): the layers below it, and the names
# the command line also knows before torch loads.
BELOW_METHODS = ("rope_ext.geometry", "rope_ext.rotation", "rope_ext.attention", "rope_ext.names")
# What an adapter may import of the method package: the contract and the settings a config states
# for a method, which hold no method; never a method's module (nor the registry, which imports them all).
METHOD_CONTRACT = ("rope_ext.method.base", "rope_ext.method.stated")


def test_methods_import_nothing_above_them():
    """No module of rope_ext.method imports the command line's arguments, the orchestration, an
    adapter or anything else above the geometry, the rotation and the attention rooms."""
    wrong = [
        (n, t)
        for n in GRAPH
        if n == "rope_ext.method" or n.startswith("rope_ext.method.")
        for t, _ in GRAPH[n]
        if not (t == "rope_ext.method" or t.startswith("rope_ext.method."))
        and not any(t == b or t.startswith(b + ".") for b in BELOW_METHODS)
    ]
    assert wrong == []


def test_adapters_know_no_method():
    """Adapters import the method contract only: which methods run on a model is decided by
    rope_ext.method.base.refusal, from the facts the adapter finds, not by an adapter that knows a
    method's class or module."""
    wrong = [
        (n, t)
        for n in GRAPH
        if n == "rope_ext.patches" or n.startswith("rope_ext.patches.")
        for t, _ in GRAPH[n]
        if (t == "rope_ext.method" or t.startswith("rope_ext.method.")) and t not in METHOD_CONTRACT
    ]
    assert wrong == []


def test_the_method_names_are_known_below_everything():
    """rope_ext.names, which the registry and the command line share, imports nothing of ours."""
    assert GRAPH["rope_ext.names"] == []


def test_one_check_decides_whether_a_method_runs_on_a_model():
    """`refusal` checks a method's requirements against the adapter's facts: on a model that takes
    every method it refuses none; on one that takes none (no AttentionInterface, an unknown backend,
    bidirectional attention, a rotation rope-ext cannot stand in for, ...) it refuses every method
    but the static frequency changes, naming the method."""
    from rope_ext.method.base import ModelFacts, refusal

    plain = ModelFacts("any", "sdpa", 4, True, True)
    assert {name: refusal(spec, plain, 256) for name, spec in methods.REGISTRY.items()} == dict.fromkeys(methods.REGISTRY)
    worst = ModelFacts(
        "any",
        "flex_attention",
        4,
        False,
        False,
        static_only="a reason",
        not_plain_attention="another",
        rotation_elsewhere="elsewhere",
        keys_hidden=lambda length: "a chunk",
        sliding_window=8,
    )
    refused = {name: refusal(spec, worst, 256) for name, spec in methods.REGISTRY.items()}
    static = {name for name, spec in methods.REGISTRY.items() if spec.rotation == "static" and not spec.needs_attention_interface}
    assert {name for name, reason in refused.items() if reason is None} == static
    assert all(reason.startswith(name) for name, reason in refused.items() if reason is not None)


def test_orchestration_names_no_method_and_no_family():
    tree = ast.parse(MODULES["rope_ext.patching"].read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node)
    }
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | keys
    }
    names = set(methods.REGISTRY) | {a.name for a in ADAPTERS} | {t for a in ADAPTERS for t in a.model_types}
    assert not {s for s in strings for n in names if n in s.replace("'", " ").split()}
    identifiers = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not {i for i in identifiers if any(n in i.lower() for n in ("alibi", "self_extend", "llama", "chatglm", "glm"))}


def test_every_registered_method_is_a_method_with_the_declared_parts():
    for name, spec in methods.REGISTRY.items():
        assert isinstance(spec, methods.Method) and spec.name == name
        assert set(rope_ext.methods()[name]["params"]) == {"factor", *spec.all_params}


EXPORTING = sorted(n for n, path in MODULES.items() if "\n__all__ =" in path.read_text())


@pytest.mark.parametrize("name", EXPORTING)
def test_every_name_a_package_exports_is_defined(name):
    """`from package import *` would raise on a name in `__all__` that the package does not define."""
    package = importlib.import_module(name)
    assert [n for n in package.__all__ if not hasattr(package, n)] == []


@pytest.mark.slow  # spawns an interpreter
def test_the_code_follows_its_formatter():
    """`ruff format` with the project's configuration (pyproject.toml) leaves every file as it is."""
    result = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_front_door_points_to_the_registry_and_stays_short():
    """The README's pitch (its first paragraph) and pyproject's description say what kinds of
    methods there are and point to `rope-ext methods` for them, naming none of them: the registry
    is the one list (a new method is one module and one registry line). The README stays about 200
    lines (results, benchmarks and concepts live in docs/)."""
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    pitch = readme.split("\n\n")[1]
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    for text in (pitch, description):
        assert "`rope-ext methods`" in text and "frequency scalings" in text and "attention-side methods" in text
        assert not [name for name in methods.REGISTRY if re.search(rf"`{name}`|\b{name}\b,", text)], text
    assert len(readme.splitlines()) <= 200


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
