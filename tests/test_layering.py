"""The floors hold: read every module's top-level imports (as the interpreter runs them on import, so not those
inside functions or under `if TYPE_CHECKING:`) and check that no floor imports one above it and that no two
packages import each other."""

import ast
import sys
from pathlib import Path

import leanlm

ROOT = Path(leanlm.__file__).parent
# The floors, lowest first (docs/ARCHITECTURE.md): a module may import its own floor and those below, never above.
FLOORS = (
    # the runtime: the model, its low-bit format, caches and kernels, decoding, and what they stand on
    ("errors", "fetch", "runtime", "kernels", "tokenizer", "lowbit", "models", "cache", "generation"),
    # algorithms that write the runtime's format, the serving engine, measurement of one model
    ("compress", "engine", "eval", "analysis"),
    # jobs that run models and use the algorithms: training, recipes, sweeps, benchmarks, the server
    ("distillation", "prompt", "pipeline", "optimize", "bench", "serve"),
    # front ends
    ("cli", "api"),
)
FLOOR = {package: i for i, floor in enumerate(FLOORS) for package in floor}


def top_level_imports(path: Path) -> set[str]:
    """Dotted leanlm modules a file imports when it is imported."""
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    out = set()
    for node in ast.parse(path.read_text()).body:  # module level only
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parts = module.split(".")[: -node.level]
                base = ".".join(parts + ([base] if base else []))
            # `from leanlm import kernels` imports leanlm.kernels
            out |= {f"{base}.{a.name}" if base == "leanlm" else base for a in node.names}
    return {m for m in out if m.startswith("leanlm.")}


def package(module: str) -> str:
    """leanlm.cache.paged -> cache; leanlm.runtime -> runtime."""
    return module.split(".")[1]


def edges() -> dict[str, set[tuple[str, str]]]:
    """{importing module: {(imported module, its package)}} for every module of leanlm."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {(m, package(m)) for m in top_level_imports(path)}
    return graph


def test_every_package_has_a_floor():
    packages = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
                if p.suffix == ".py" and p.stem != "__init__" or p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOOR), f"give each package a floor: {sorted(packages ^ set(FLOOR))}"


def test_no_lower_floor_imports_a_higher_one():
    upward = sorted(f"{m} -> {target}" for m, targets in edges().items() if "." in m
                    for target, pkg in targets if FLOOR[pkg] > FLOOR[package(m)])
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_two_packages_import_each_other():
    by_package: dict[str, set[str]] = {}
    for m, targets in edges().items():
        if "." in m:
            by_package.setdefault(package(m), set()).update(pkg for _, pkg in targets if pkg != package(m))
    circles = sorted({tuple(sorted((a, b))) for a, deps in by_package.items() for b in deps
                      if a in by_package.get(b, ())})
    assert not circles, f"packages that import each other at module level: {circles}"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The reading itself: a module-level import is found, one inside a function or under TYPE_CHECKING is not."""
    fake = tmp_path / "leanlm"
    (fake / "cache").mkdir(parents=True)
    (fake / "cache" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nfrom leanlm.compress import a\nfrom leanlm import serve\n"
        "if TYPE_CHECKING:\n    from leanlm.engine import b\n"
        "def f():\n    from leanlm.optimize import c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert top_level_imports(fake / "cache" / "x.py") == {"leanlm.compress", "leanlm.serve"}
