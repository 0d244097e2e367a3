"""The documentation stays true to the repository: links resolve, options tables match the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mpisolve.solvers
from mpisolve.options import OPTIONS_TABLE
from mpisolve.solvers.option_docs import regenerated

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SOLVER_PAGES = sorted((ROOT / "docs" / "solvers").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            slug = github_slug(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    """The relative link targets of ``page``, outside code blocks."""
    targets = LINK.findall(FENCE.sub("", page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_docs_tree_has_its_fixed_layout():
    names = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    guide = {f"guide/{n}.md" for n in ("install", "your-loop", "cli", "checkpoints-and-logs", "clusters", "gpus")}
    solvers = {f"solvers/{n}.md" for n in ("allreduce", "adasum", "abs-sgd", "kfac", "elastic", "baselines")}
    internals = {f"internals/{n}.md" for n in ("comm", "kernels", "benchmarks", "solvers")}
    required = {"index.md", "guide/reliability.md", *guide, *solvers, *internals}
    assert required <= names, f"missing pages: {sorted(required - names)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](missing.md) [anchor](page.md#nope)\n")
    page.write_text(page.read_text() + "```\n[in code](x.md)\n```\n")
    assert relative_links(page) == ["page.md#title", "missing.md", "page.md#nope"]
    assert anchors(page) == {"title"}
    assert github_slug("`advise`: which solver, where (measured)") == "advise-which-solver-where-measured"


@pytest.mark.parametrize("page", SOLVER_PAGES, ids=lambda p: p.name)
def test_options_tables_match_the_code(page):
    text = page.read_text()
    assert regenerated(text) == text, f"{page.relative_to(ROOT)}: options tables differ from the code: run make docs"


def test_every_solver_has_an_options_table():
    documented = set()
    for page in SOLVER_PAGES:
        for match in OPTIONS_TABLE.finditer(page.read_text()):
            documented.update(name.strip() for name in match.group(2).split(","))
    assert documented == set(mpisolve.solver_names())
