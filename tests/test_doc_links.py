"""The project's markdown links to its own files resolve: results move (a re-run's directory, a
renamed report), and the README and reports must not point at what is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a repository path written as code in a page's prose: `kernels/flash_mgpu.py`, `configs/`
CODE_PATH = re.compile(r"`((?:benchmarks|configs|diff_jax|docs|kernels|tests)/[^`\s]*)`")


def _pages() -> list[Path]:
    """The README, the docs pages and reports, and the benchmark reports."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "benchmarks").rglob("*.md"))]


def _local_targets(markdown: Path) -> list[str]:
    """The targets of `markdown`'s links that name a file of this repository (no URL, no
    in-page anchor), without their `#fragment`."""
    return [target.split("#")[0] for target in LINK.findall(markdown.read_text())
            if not target.startswith(("http://", "https://", "#", "mailto:"))]


def test_every_local_link_in_the_readme_and_the_reports_names_a_file_that_exists():
    checked, missing = 0, []
    for page in _pages():
        for target in _local_targets(page):
            checked += 1
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing
    assert checked >= 10  # the README alone links its results directories and design notes


def _heading_anchors(markdown: Path) -> set[str]:
    """The anchors GitHub gives `markdown`'s headings: lower case, punctuation dropped (letters,
    digits, `_` and `-` kept), spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.+)$", markdown.read_text(), re.M)}


def test_every_link_to_a_section_names_a_heading_of_its_page():
    """A `page.md#section` link (or an in-page `#section`) names a heading that page has: the
    README links its sections to the docs pages, and a heading renamed or moved to another page
    would leave the link pointing at the top of the page."""
    checked, missing = 0, []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")) or "#" not in target:
                continue
            path, section = target.split("#", 1)
            linked = page.parent / path if path else page
            if linked.suffix != ".md" or not linked.exists():
                continue  # a missing page is the test above's
            checked += 1
            if section not in _heading_anchors(linked):
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing
    assert checked >= 10  # the README links the docs pages' sections


def test_every_repository_path_written_as_code_names_a_file_that_exists():
    """The pages cite code, configs and results by path as often as by link (`kernels/reference.py`,
    `benchmarks/results/tpu_fit.json`, `tests/conftest.py`), from the repository root; a file
    renamed or moved would leave them naming what is gone, which the link tests do not read."""
    checked, missing = 0, []
    for page in _pages():
        for path in CODE_PATH.findall(page.read_text()):
            checked += 1
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing
    assert checked >= 20  # the training and kernels pages name their scripts and results
