"""Draw qerl's module import graph in floors, for docs/architecture.md.

Every ``import`` / ``from ... import`` of a ``qerl`` module anywhere in a file (module level or inside a
function: a deferred import still ties the two modules together) is an edge. Modules that import each other,
directly or around a longer loop, form a circle: they are reported and drawn in red on one floor. Otherwise a
module's floor is one above the highest floor it imports from, so the ground floor imports no other qerl module
and every arrow points down. Reading the files with ``ast`` needs no import of qerl (no torch, no device).

    python docs/import_graph.py                       # writes docs/architecture.png, prints floors and circles
    python docs/import_graph.py --out /tmp/graph.png --root /path/to/checkout
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path

#: A package's modules are drawn in one colour, so the floors show which packages they mix.
COLOURS = {
    "quantize": "#C44E52",
    "load": "#DD8452",
    "kernels": "#4C72B0",
    "rollout": "#55A868",
    "train": "#937860",
    "tasks": "#DA8BC3",
    "": "#8172B2",
}


def module_name(path: Path, root: Path) -> str:
    """``qerl/kernels/fp4_gemm.py`` -> ``qerl.kernels.fp4_gemm``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that a module's syntax tree imports (relative imports resolved against ``name``)."""
    found: set[str] = set()
    here = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module; ``from pkg import name`` what pkg/__init__ defines.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path, package: str = "qerl") -> dict[str, set[str]]:
    """Module -> the package modules it imports, for every ``.py`` file under ``root/package``. A package
    ``__init__`` that only re-exports is kept: what imports ``qerl`` depends on all it pulls in."""
    files = sorted((root / package).rglob("*.py"))
    names = {module_name(f, root): f for f in files}
    known = set(names)
    return {
        name: imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in names.items()
    }


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each one is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(1000, 4 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 0 for a module importing no other, else one above the highest floor it imports;
    the members of a circle share the floor of the circle as a whole."""
    group = {m: frozenset({m}) for m in graph}
    for component in circles(graph):
        for m in component:
            group[m] = frozenset(component)
    floor: dict[frozenset[str], int] = {}

    def level(g: frozenset[str]) -> int:
        if g not in floor:
            floor[g] = -1  # in progress; a condensed graph has no loop, so this is never read
            below = {group[t] for m in g for t in graph[m]} - {g}
            floor[g] = 1 + max((level(b) for b in below), default=-1)
        return floor[g]

    return {m: level(group[m]) for m in graph}


def short(name: str) -> str:
    """The label drawn: the name inside ``qerl``."""
    return name.removeprefix("qerl.") if name != "qerl" else "qerl (package)"


def digest(graph: dict[str, set[str]]) -> str:
    """A digest of the modules and their imports, stored in the PNG (its ``Description``) so that a test can tell
    when the committed picture no longer matches the code."""
    edges = "\n".join(f"{m} -> {' '.join(sorted(graph[m]))}" for m in sorted(graph))
    return "qerl import graph sha256 " + hashlib.sha256(edges.encode()).hexdigest()


def draw(graph: dict[str, set[str]], out: Path) -> None:
    """The floors as rows (ground at the bottom), the imports as arrows, circles in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    level = floors(graph)
    red = {m for c in circles(graph) for m in c}
    rows: dict[int, list[str]] = {}
    for m in sorted(graph, key=lambda m: (m.count("."), m)):
        rows.setdefault(level[m], []).append(m)
    width = max(len(r) for r in rows.values())
    fig, ax = plt.subplots(figsize=(max(12, 1.9 * width), 1.3 * len(rows) + 1))
    where = {}
    for f, members in rows.items():
        for i, m in enumerate(members):
            where[m] = ((i + 0.5) * width / len(members), f)
    for m, targets in graph.items():
        for t in targets:
            (x0, y0), (x1, y1) = where[m], where[t]
            colour = "#d62728" if m in red and t in red else "#999999"
            ax.annotate(
                "",
                xy=(x1, y1 + 0.12),
                xytext=(x0, y0 - 0.12),
                arrowprops=dict(arrowstyle="->", color=colour, lw=0.6, alpha=0.6),
            )
    for m, (x, y) in where.items():
        package = m.split(".")[1] if m.count(".") > 1 else ""
        edge = "#d62728" if m in red else "white"
        ax.text(
            x,
            y,
            short(m),
            ha="center",
            va="center",
            fontsize=8,
            color="white",
            bbox=dict(boxstyle="round,pad=0.3", fc=COLOURS.get(package, COLOURS[""]), ec=edge, lw=2),
        )
    ax.set_yticks(sorted(rows), [f"floor {f}" for f in sorted(rows)])
    ax.set_xticks([])
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-0.6, max(rows) + 0.6)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    title = (
        "qerl imports (arrows point to the imported module; red quantize, orange load, blue kernels, green rollout, "
        "brown train, pink tasks)"
    )
    ax.set_title(title + (f"; {len(circles(graph))} circle(s) in red" if red else "; no circles"), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=130, metadata={"Description": digest(graph)})
    plt.close(fig)


def report(graph: dict[str, set[str]]) -> Iterable[str]:
    """The floors, top down, and any circles: what docs/architecture.md's paragraphs describe."""
    level = floors(graph)
    for f in sorted(set(level.values()), reverse=True):
        yield f"floor {f}: " + ", ".join(short(m) for m in sorted(graph) if level[m] == f)
    for c in circles(graph):
        yield "circle: " + " <-> ".join(short(m) for m in sorted(c))


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=here.parent, help="the checkout holding qerl/")
    parser.add_argument("--out", type=Path, default=here / "architecture.png")
    args = parser.parse_args(argv)
    if not (args.root / "qerl").is_dir():
        sys.exit(f"error: --root {args.root}: expected a checkout with a qerl/ folder")
    graph = import_graph(args.root)
    draw(graph, args.out)
    print("\n".join(report(graph)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
