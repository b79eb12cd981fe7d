"""The project's markdown links to its own files resolve: results move (a re-run's directory, a
renamed report), and the README and reports must not point at what is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _local_targets(markdown: Path) -> list[str]:
    """The targets of `markdown`'s links that name a file of this repository (no URL, no
    in-page anchor), without their `#fragment`."""
    return [target.split("#")[0] for target in LINK.findall(markdown.read_text())
            if not target.startswith(("http://", "https://", "#", "mailto:"))]


def test_every_local_link_in_the_readme_and_the_reports_names_a_file_that_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "benchmarks").rglob("*.md"))]
    checked, missing = 0, []
    for page in pages:
        for target in _local_targets(page):
            checked += 1
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, missing
    assert checked >= 10  # the README alone links its results directories and design notes
