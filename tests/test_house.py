"""The house rules a newcomer relies on (issue 62's measures): every module of ``qerl/`` reads in at most 400
lines and every function in at most 60, except the Triton / Gluon kernels themselves (one GPU program each,
whose body cannot be split across Python functions without changing what the compiler sees)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

QERL = Path(__file__).resolve().parents[1] / "qerl"
MODULES = sorted(QERL.rglob("*.py"))


def _is_kernel(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in {"triton.jit", "gluon.jit"} for d in node.decorator_list)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(QERL)))
def test_module_reads_on_a_few_screens(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= 400, f"{path.relative_to(QERL)}: {lines} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(QERL)))
def test_functions_read_on_one_screen(path: Path) -> None:
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not _is_kernel(node)
        and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"{path.relative_to(QERL)}: {', '.join(long)}"


def test_the_layout_follows_the_pipeline() -> None:
    """The README's steps are the package's folders; the flat top level holds only shared modules."""
    packages = {p.name for p in QERL.iterdir() if (p / "__init__.py").is_file()}
    assert {"quantize", "load", "kernels", "rollout", "train"} <= packages
    top = {p.stem for p in QERL.glob("*.py")}
    assert top <= {
        "__init__",
        "arch",
        "checkpoint",
        "cli",
        "export",
        "fsutil",
        "hub",
        "nvfp4",
        "plot",
        "runlock",
        "trainer",
    }


def test_the_public_import_paths_stay() -> None:
    """The paths the README calls public keep working after the move by stage (re-exports and CLI shims)."""
    import qerl
    import qerl.trainer

    assert {"load_model", "load_tokenizer", "NVFP4Linear"} <= set(qerl.__all__)
    from qerl.train.trainer import QeRLConfig, QeRLTrainer

    assert (qerl.trainer.QeRLTrainer, qerl.trainer.QeRLConfig) == (QeRLTrainer, QeRLConfig)
    for cli in ("qerl/train/__main__.py", "qerl/plot.py", "qerl/export.py"):
        assert (QERL.parent / cli).is_file(), cli


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` runs exactly the README's test line: the linter, the formatter's check and the CPU suite."""
    root = QERL.parent
    readme = (root / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith(".venv/bin/ruff check ."))
    steps = [step.strip() for step in line.split("&&")]
    ci = [x.strip() for x in (root / ".ci" / "run").read_text().splitlines()]
    assert steps == [".venv/bin/ruff check .", ".venv/bin/ruff format --check .", ".venv/bin/python -m pytest -q tests"]
    assert [x for x in ci if x in steps] == steps


def _imported(path: Path, node: ast.AST) -> list[str]:
    """The qerl modules (or names in them) an import statement of ``path`` reaches, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    package = list(path.relative_to(QERL.parent).with_suffix("").parts[:-1])
    base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
    module = ".".join(p for p in (base, node.module or "") if p)
    return [module] + [f"{module}.{a.name}" for a in node.names]


def test_the_kernels_import_nothing_from_the_rollout() -> None:
    """``qerl/kernels/`` answers shape questions (which kernel serves an M, N, K and dtype); the rollout's step plan asks
    them and decides, so no kernels module imports ``qerl.rollout``, deferred imports included."""
    found = [
        f"{path.relative_to(QERL)}: {name}"
        for path in sorted((QERL / "kernels").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        for name in _imported(path, node)
        if name == "qerl.rollout" or name.startswith("qerl.rollout.")
    ]
    assert not found, found


def test_the_step_plan_names_its_types() -> None:
    """The rollout's step plan reads the model view, its groups and norms by their own types: no ``Any`` in it."""
    tree = ast.parse((QERL / "rollout" / "step_plan.py").read_text())
    anys = [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute) and node.attr == "Any")
    ]
    assert not anys, f"qerl/rollout/step_plan.py: Any at lines {anys}"
