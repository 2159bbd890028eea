"""No import cycle hidden behind a lazy import (issue 37): where a pdserve module imports another
inside a function or under `if TYPE_CHECKING:`, the other must not import it back, directly or
through the modules it imports at its top. A lazy import is for a heavy or optional dependency
(torch.distributed, NIXL, redis, the compiler), never to break a cycle. A package's own
submodules loaded by name (the connector registry's `importlib`) are not imports here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """pdserve's module names and their files, by pyproject's package-dir mapping."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    out: dict[str, Path] = {}
    for package in config["packages"]:
        top = max((p for p in folders if package == p or package.startswith(p + ".")), key=len)
        folder = REPO / folders[top] / Path(*package[len(top) :].split(".")[1:])
        for f in folder.glob("*.py"):
            out[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The pdserve module an import of `name` loads (a name inside a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, lazy) of every pdserve import in `path`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, lazy: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                names = [f"{base}.{a.name}" for a in child.names]
            for target in {_target(n) for n in names if n.startswith("pdserve")} - {None, module}:
                yield target, child.lineno, lazy
            inner = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            )
            yield from walk(child, lazy or inner)

    yield from walk(ast.parse(path.read_text(), filename=str(path)), False)


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def _cycles(modules: dict[str, Path]) -> list[str]:
    found = {m: list(_imports(m, p)) for m, p in modules.items()}
    top = {m: {t for t, _, lazy in imps if not lazy} for m, imps in found.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, stack = {start}, [start]
        while stack:
            for nxt in top.get(stack.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    return [
        f"{_shown(modules[m])}:{line} imports {target} lazily; it imports {m} back"
        for m, imps in found.items()
        for target, line, lazy in imps
        if lazy and reaches(target, m)
    ]


def test_no_import_cycle_hides_behind_a_lazy_import() -> None:
    assert len(MODULES) > 150, "the package mapping was not read"
    cycles = _cycles(MODULES)
    assert not cycles, "\n".join(cycles)


def test_the_check_finds_cycles_behind_function_and_type_checking_imports(tmp_path: Path) -> None:
    files = {
        "a": "def f():\n    from pdserve.fake.b import g\n",  # b imports a back: a cycle
        "b": "from pdserve.fake.a import f\nfrom pdserve.fake.c import x\n",
        "c": "import typing\nif typing.TYPE_CHECKING:\n    from pdserve.fake.b import g\n",
        "d": "def f():\n    from pdserve.fake.b import g\n",  # nothing imports d: no cycle
    }
    fake = {f"pdserve.fake.{name}": tmp_path / f"{name}.py" for name in files}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    MODULES.update(fake)
    try:
        cycles = _cycles(fake)
    finally:
        for name in fake:
            del MODULES[name]
    assert sorted(c.split(" ")[0].rsplit("/", 1)[-1] for c in cycles) == ["a.py:2", "c.py:3"], (
        cycles
    )
