"""The figures the README and docs/ quote can be traced and re-run: every result file they cite exists (or, for a
file that left the tree, exists at the commit they name), and every result document under benchmarks/results/
names in its ``command`` a committed script that accepts the flags it records. Also the size limits that keep the
docs and the results folder readable at a glance, and no history words in them (the facts and their sources, not who found them when)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: A cited result file: a path under benchmarks/results/, or such a path at a commit (``git show C:path``).
CITED = re.compile(r"(?:git show ([0-9a-f]{7,40}):)?(benchmarks/results/[\w./-]*\w)")
#: Bare result-file names in a cell or list that follows a full path, e.g. "`rollout.json`, `grpo_step_72b.json`".
BARE = re.compile(r"`([\w-]+\.(?:json|png|txt))`")
#: A result file marked as left the tree (`` `name.json`† ``), and the one sentence that names the commit holding every
#: such file of a document ("marked † ... at commit `C`"), said once instead of a ``git show C:`` per file.
MARKED = re.compile(r"`([\w.-]+)`†")
MARKED_AT = re.compile(r"marked † .*? at commit\s+`([0-9a-f]{7,40})`", re.DOTALL)


def cited(text: str) -> list[tuple[str | None, str]]:
    """(commit or None, path) of every result file or folder a document cites; a file marked † is at the commit
    the document names for them (None, so it must be in the tree, where it names none)."""
    at = MARKED_AT.search(text)
    marked = [(at and at.group(1), f"benchmarks/results/{name}") for name in MARKED.findall(text)]
    return [(m.group(1), m.group(2)) for m in CITED.finditer(text)] + marked


def script_of(command: str) -> Path | None:
    """The committed script a result's command runs: ``-m benchmarks.X``, ``benchmarks/X.py`` or a ``training/`` one."""
    m = re.search(r"-m\s+(benchmarks\.\w+)|(benchmarks/\w+\.py)|(training/\w+\.sh)", command)
    if m is None:
        return None
    return ROOT / (m.group(1).replace(".", "/") + ".py" if m.group(1) else m.group(2) or m.group(3))


def result_documents() -> list[Path]:
    """The JSON documents a reader takes figures from: the folder's top level and each run folder's run.json."""
    return sorted(RESULTS.glob("*.json")) + sorted(RESULTS.glob("*/run.json"))


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_every_cited_result_file_exists(doc: Path) -> None:
    text = doc.read_text()
    found = cited(text)
    missing = [path for commit, path in found if commit is None and not (ROOT / path).exists()]
    assert not missing, f"{doc.name} cites result files that do not exist: {missing}"
    bare = {name for name in BARE.findall(text) if not (RESULTS / name).exists() and not (ROOT / name).exists()}
    bare -= {Path(path).name for commit, path in found if commit}  # named again right after its git show
    assert not {n for n in bare if n.startswith(("rollout", "kernels", "grpo", "decode", "shrink", "learning"))}, (
        f"{doc.name} names result files that are not in benchmarks/results/: {sorted(bare)}"
    )


def test_files_cited_at_a_commit_exist_there() -> None:
    """``git show C:benchmarks/results/X`` must work, so a figure whose file left the tree stays reproducible."""
    git = shutil.which("git")
    pairs = {(c, p) for doc in [ROOT / "README.md", *DOCS] for c, p in cited(doc.read_text()) if c}
    assert pairs, "the docs cite no file at a commit: this test would check nothing"
    if (
        git is None
        or subprocess.run(
            [git, "-C", str(ROOT), "cat-file", "-e", next(iter(pairs))[0]], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("no git history here (a source export or a shallow clone)")
    absent = [
        f"{c}:{p}"
        for c, p in sorted(pairs)
        if subprocess.run([git, "-C", str(ROOT), "cat-file", "-e", f"{c}:{p}"], capture_output=True).returncode
    ]
    assert not absent, f"not in git at the cited commit: {absent}"


@pytest.mark.parametrize("path", result_documents(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_result_names_a_committed_script_and_its_flags(path: Path) -> None:
    doc = json.loads(path.read_text())
    command = doc.get("command") if isinstance(doc, dict) else None
    assert isinstance(command, str) and command, f"{path.name}: no command"
    script = script_of(command)
    assert script is not None and script.is_file(), f"{path.name}: {command!r} names no committed script"
    if script.suffix == ".py":
        source = script.read_text()
        first = command.split(";")[0]  # a merge step after ';' runs the same script
        unknown = [f for f in re.findall(r"(?<!\S)(--[a-z][\w-]*)", first) if f'"{f}"' not in source]
        assert not unknown, f"{path.name}: {script.name} has no flag {unknown}"
        kernel_ab = re.search(r"--kernel-ab\s+(\w+)", first)
        if kernel_ab:
            from benchmarks.rollout_ab import AB_SWITCHES

            assert kernel_ab.group(1) in AB_SWITCHES, f"{path.name}: --kernel-ab {kernel_ab.group(1)} is not a mode"
        # A constant that moved since the run: ``rerun`` spells the same A/B with today's names.
        stale = [c for c in ab_constants(doc.get("rerun", first)) if not assigned_in_module(c)]
        assert not stale, f"{path.name}: --ab-constant sets {stale}, which the code no longer assigns"


def ab_constants(command: str) -> list[str]:
    """The ``MODULE.NAME`` of every ``--ab-constant MODULE.NAME=A:B`` in a command."""
    found = re.search(r"--ab-constant((?:\s+[\w.]+=\S+)+)", command)
    return [spec.split("=")[0] for spec in found.group(1).split()] if found else []


def assigned_in_module(qualified: str) -> bool:
    """Whether ``qerl.x.y.NAME`` is assigned at the top level of ``qerl/x/y.py`` (what setting it at run time changes;
    a name the module only imports would change nothing the kernels read)."""
    import ast

    module, _, name = qualified.rpartition(".")
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return False
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def test_the_results_folder_and_the_docs_stay_small() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 60, f"benchmarks/results holds {len(files)} files (at most 60: one current file per benchmark)"
    lines = sum(len(p.read_text().splitlines()) for p in DOCS)
    assert lines < 1500, f"docs/*.md: {lines} lines"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 350
    assert {p.stem for p in DOCS} >= {
        "kernels",
        "rollout",
        "training",
        "quantization",
        "evaluation",
        "performance",
        "architecture",
    }


def _checkout_files() -> list[Path]:
    """The files git tracks or would track (not what .gitignore covers: runs, caches, the venv); every file below
    the root where there is no git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return list(ROOT.rglob("*"))
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


#: The project's own text: code, tests, docs, scripts and recipes (result JSONs record commands, not prose), the
#: same in a fresh clone as after the quickstart wrote runs/.
TEXT_FILES = sorted(
    p
    for p in _checkout_files()
    if p.suffix in (".py", ".md", ".sh", ".yaml", ".toml")
    and not {".venv", ".git", ".dev", "results", "build"} & set(p.relative_to(ROOT).parts[:-1])
    and ".egg-info" not in str(p)
)


@pytest.mark.parametrize("doc", TEXT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_words(doc: Path) -> None:
    """Facts and their sources, not the chronology of their finding: the word is an API word only (pytest's
    fixture scope, subprocess's start_new_session)."""
    hits = [
        line.strip()
        for line in doc.read_text().splitlines()
        if re.search(r"\bsessions?\b", line, re.IGNORECASE)
        and 'scope="session"' not in line
        and "start_new_session" not in line
    ]
    assert not hits, f"{doc.name}: {hits[:3]}"


#: A code file the README and docs/ name by its path (one cited at a commit, ``git show C:path``, is the commit's).
CODE_PATH = re.compile(
    r"(?<![\w/.:-])((?:qerl|eval|tests|benchmarks|training|examples|llm-compressor)/[\w/.-]*\w\.(?:py|sh|yaml))"
)
#: A test file named without its folder (``test_faults.py``): one of tests/.
TEST_FILE = re.compile(r"(?<![\w/.:-])(test_\w+\.py)")
#: A module (or a name in one) the README and docs/ name by its dotted path: ``qerl.train.config.TRL_DEFAULT_OVERRIDES``.
DOTTED = re.compile(r"(?<![\w/.-])((?:qerl|eval)(?:\.\w+)+)")
#: Public-looking names that moved, -> where they went: a document may name one only beside its new place.
MOVED = {"qerl.config": "qerl.train.config"}


def _module_file(name: str) -> Path | None:
    path = ROOT / name.replace(".", "/")
    return next((f for f in (path / "__init__.py", path.with_suffix(".py")) if f.is_file()), None)


def _defined(module: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports, ``__all__``)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    return names


def _names_something(dotted: str) -> bool:
    """Whether ``dotted`` is a module of the tree, or a module and a name it defines (or a module of its package)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:i]))
        if module is not None:
            return i == len(parts) or parts[i] in _defined(module)
    return False


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_every_module_and_code_file_named_exists(doc: Path) -> None:
    """A module, function or file the docs name is in the tree: a move renames it in the docs too, and a public-looking
    name that moved (:data:`MOVED`) is named only beside where it went."""
    text = doc.read_text()
    missing = [path for path in CODE_PATH.findall(text) if not (ROOT / path).is_file()]
    missing += [name for name in TEST_FILE.findall(text) if not (ROOT / "tests" / name).is_file()]
    for dotted in DOTTED.findall(text):
        moved = MOVED.get(dotted)
        if not _names_something(dotted) and (moved is None or moved not in text):
            missing.append(dotted)
    assert not missing, f"{doc.name}: {sorted(set(missing))}"
