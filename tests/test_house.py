"""The house rules a newcomer relies on (issue 62's measures): every module of ``qerl/`` reads in at most 400
lines and every function in at most 60, except the Triton / Gluon kernels themselves (one GPU program each,
whose body cannot be split across Python functions without changing what the compiler sees)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

QERL = Path(__file__).resolve().parents[1] / "qerl"
MODULES = sorted(QERL.rglob("*.py"))
#: The stages, bottom up: a module of ``qerl/`` or ``eval/`` imports modules of its own stage and of earlier ones
#: only, deferred imports included. An entry names a module or a package (all of its modules, ``qerl`` itself
#: excepted: it is the package's ``__init__``); the longest entry that fits a module decides its stage.
STAGES: tuple[tuple[str, ...], ...] = (
    # shared by several stages: the format and its files, the model families, what a model directory may hold, the
    # content digests, one-line errors, atomic writes, the run lock, where models come from
    (
        "qerl.arch",
        "qerl.checkpoint",
        "qerl.cli",
        "qerl.config_fields",
        "qerl.fingerprint",
        "qerl.fsutil",
        "qerl.hub",
        "qerl.model_files",
        "qerl.nvfp4",
        "qerl.runlock",
    ),
    ("qerl.tasks",),  # what a model is asked and how its answer is judged: calibration, training and eval read it
    ("qerl.kernels",),  # answers shape questions; the rollout's step plan asks them and decides
    ("qerl.quantize",),
    ("qerl.load",),
    ("qerl.rollout",),
    ("qerl.train",),
    ("qerl.export", "eval"),
    # the public names and commands over several stages: the package's lazy names (qerl.load), the trl drop-in's
    # path, python -m qerl.plot, and the quantize command, which smoke-tests its output through qerl's loader
    ("qerl", "qerl.trainer", "qerl.plot", "qerl.quantize.run", "qerl.quantize.__main__"),
)


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
    assert {"tasks", "quantize", "load", "kernels", "rollout", "train"} <= packages
    top = {p.stem for p in QERL.glob("*.py")}
    assert top <= {
        "__init__",
        "arch",
        "checkpoint",
        "cli",
        "config_fields",
        "export",
        "fingerprint",
        "fsutil",
        "hub",
        "model_files",
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
    for cli in ("qerl/train/__main__.py", "qerl/plot.py", "qerl/export.py", "llm-compressor/quantize_nvfp4.py"):
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


def _import_edges() -> list[tuple[str, str]]:
    """(module, module it imports) for every import of another module of ``qerl/`` or ``eval/`` anywhere in a file,
    read with ``docs/import_graph.py`` (the picture's reader: relative imports resolved, ``from pkg import name`` the
    package unless ``name`` is a module)."""
    spec = importlib.util.spec_from_file_location("import_graph", QERL.parent / "docs" / "import_graph.py")
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    files = {
        graph.module_name(f, QERL.parent): f for d in ("qerl", "eval") for f in sorted((QERL.parent / d).rglob("*.py"))
    }
    return [
        (name, target)
        for name, path in files.items()
        for target in sorted(graph.imported(ast.parse(path.read_text()), name, path.name == "__init__.py", set(files)))
    ]


def _stage(module: str) -> int | None:
    """The index in :data:`STAGES` of the longest entry that fits ``module``; None when none does."""
    fits = [
        (len(entry), rank)
        for rank, entries in enumerate(STAGES)
        for entry in entries
        if module == entry or (entry != "qerl" and module.startswith(f"{entry}."))
    ]
    return max(fits)[1] if fits else None


def test_every_module_has_a_stage() -> None:
    """A new module is placed in :data:`STAGES` (a new top-level one is a decision: shared floor or command)."""
    modules = {m for edge in _import_edges() for m in edge}
    assert not sorted(m for m in modules if _stage(m) is None)


def test_no_stage_imports_a_later_one() -> None:
    """The pipeline's order holds in the imports: nothing imports a stage that comes after its own (quantize no
    train, eval no more than what a command of its stage may: tasks, load, rollout)."""
    names = [" / ".join(entries) for entries in STAGES]
    backwards = [
        f"{module} ({names[_stage(module)]}) imports {target} ({names[_stage(target)]})"
        for module, target in _import_edges()
        if _stage(target) > _stage(module)
    ]
    assert not backwards, backwards


def test_the_kernels_import_nothing_from_the_rollout() -> None:
    """``qerl/kernels/`` answers shape questions (which kernel serves an M, N, K and dtype); the rollout's step plan asks
    them and decides, so no kernels module imports ``qerl.rollout``, deferred imports included."""
    found = [
        f"{module}: {target}"
        for module, target in _import_edges()
        if module.startswith("qerl.kernels") and (target == "qerl.rollout" or target.startswith("qerl.rollout."))
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
