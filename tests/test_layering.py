"""Imports only point down: no module imports one from a package above it, at file top or inside a function.

The floors, lowest first (docs/map.md draws them). A module may import its own floor and any floor below it;
`if TYPE_CHECKING:` imports (annotations only) are exempt. A lazy import that exists to dodge a cycle means the
code sits in the wrong file: move it, do not hide it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "leverlab"

# Each floor: the top-level modules and packages of leverlab that live on it.
FLOORS: list[set[str]] = [
    {"config", "chat", "env", "errors", "hub", "outputs", "sampling_params", "engine_args", "quant_config",
     "speculative_config"},
    {"kernels"},
    {"distributed"},
    {"quant"},
    {"layers"},
    {"models"},
    {"core", "structured"},
    {"worker"},
    {"speculative"},
    {"engine"},
    {"server"},
    {"llm"},
    {"bench", "study", "train"},
    {"cli", "cmd_generate", "__init__"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
# The root package's lazy exports (leverlab/__init__.py): `from leverlab import LLM` is an import of llm.py.
EXPORTS = {"LLM": "llm", "SamplingParams": "sampling_params", "StructuredOutputsParams": "sampling_params"}


def _part(module: str) -> str:
    """leverlab.engine.llm_engine -> engine; leverlab -> __init__ (the package's own lazy exports)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """Every leverlab module that this file imports (top level and inside functions), with its line."""
    found: list[tuple[str, int]] = []
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "leverlab")
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "leverlab":
                if target == "leverlab":  # from leverlab import env, LLM: each name is a module of its own
                    found.extend((f"leverlab.{a.name}", node.lineno) for a in node.names)
                else:  # from leverlab.engine import client: the submodule where a name is one
                    found.extend((f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target, node.lineno)
                                 for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_part_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts - FLOOR.keys() == set(), "give these a floor in FLOORS (and docs/map.md)"


def test_imports_point_down():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        here = FLOOR[_part(module)]
        for target, line in _imports(path, module):
            name = EXPORTS.get(_part(target), _part(target))
            if target == "leverlab" or name == "__version__":  # the root package's own constants
                continue  # (__version__, __file__): its lazy exports are imported by name, above
            there = FLOOR.get(name)
            assert there is not None, f"{module}:{line} imports {target}, which has no floor"
            if there > here:
                upward.append(f"{module} (floor {here}: {_part(module)}) imports {target} (floor {there}) "
                              f"at {path.relative_to(ROOT.parent)}:{line}")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_the_server_meets_the_engine_through_its_client_protocol_only():
    """server/'s HTTP side imports engine.client (EngineClient, EnginePrompt) and the plain types, nothing else of
    ours outside server/; only cli.py, which builds the engine for `leverlab serve`, reaches further."""
    allowed = {"leverlab.engine.client"} | {f"leverlab.{name}" for name in FLOORS[0]}
    wrong = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        module = _module_name(path)
        if module == "leverlab.server.cli":
            continue
        for target, line in _imports(path, module):
            if target in ("leverlab", "leverlab.__version__") or target.startswith("leverlab.server") or target in allowed:
                continue
            wrong.append(f"{module} imports {target} at {path.relative_to(ROOT.parent)}:{line}")
    assert not wrong, "the server reaches past EngineClient:\n" + "\n".join(wrong)
