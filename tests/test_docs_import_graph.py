"""docs/import_graph.py, which draws docs/architecture.md's picture: on a made-up package it finds every import
form (module level, deferred, relative, ``from pkg import module``), puts each module one floor above what it
imports, and reports a circle as one floor; on qerl it runs without importing qerl and writes the PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "qerl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_floors_and_circles_of_a_made_up_package(graph_tool: ModuleType, tmp_path: Path) -> None:
    _package(
        tmp_path,
        {
            "__init__.py": "",
            "ground.py": "import os\n",
            "kernels/__init__.py": "",
            "kernels/a.py": "from . import b\nfrom qerl.ground import X\n",
            "kernels/b.py": "def f():\n    from qerl.kernels.a import g\n",  # deferred: still an edge
            "layer.py": "from qerl.kernels import a\n",
            "top.py": "import qerl.layer\nfrom qerl import ground\n",
        },
    )
    graph = graph_tool.import_graph(tmp_path)
    assert graph["qerl.kernels.a"] == {"qerl.kernels.b", "qerl.ground"}
    assert graph["qerl.kernels.b"] == {"qerl.kernels.a"}
    assert graph["qerl.layer"] == {"qerl.kernels.a"}  # the module, not the package's __init__
    assert graph["qerl.top"] == {"qerl.layer", "qerl.ground"}
    assert graph_tool.circles(graph) == [{"qerl.kernels.a", "qerl.kernels.b"}]
    floor = graph_tool.floors(graph)
    assert floor["qerl.ground"] == 0 and floor["qerl.kernels.a"] == floor["qerl.kernels.b"] == 1
    assert (floor["qerl.layer"], floor["qerl.top"]) == (2, 3)
    assert "circle: kernels.a <-> kernels.b" in list(graph_tool.report(graph))


def test_the_qerl_picture_is_drawn_from_the_code(graph_tool: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "architecture.png"
    graph_tool.main(["--root", str(ROOT), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    graph = graph_tool.import_graph(ROOT)
    assert "qerl.kernels.schedule" in graph and graph_tool.floors(graph)["qerl.train.run"] > 0


def test_a_checkout_without_qerl_is_refused(graph_tool: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="expected a checkout with a qerl/ folder"):
        graph_tool.main(["--root", str(tmp_path)])


def test_the_committed_picture_matches_the_code(graph_tool: ModuleType) -> None:
    """docs/architecture.png carries the digest of the graph it was drawn from: a module added, moved or importing
    something new makes it stale, and this names the command that redraws it."""
    from PIL import Image

    drawn = Image.open(ROOT / "docs" / "architecture.png").info.get("Description")
    assert drawn == graph_tool.digest(graph_tool.import_graph(ROOT)), "stale picture: run python docs/import_graph.py"
