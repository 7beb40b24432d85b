"""docs/benchmarks.md holds every measured figure the other documents quote (issue 36 item 6).

A figure is a number with a unit of time or rate, or a ratio: `24.4 ms`, `1.26-1.31x`, `0.89×`,
`2.53 GiB/s`. Each one README.md and docs/*.md quote must also be on docs/benchmarks.md, where
the command that measured it is; the page quoting it links there. The check is by number, not by
sentence: a figure quoted in other words still passes, a new one measured and quoted elsewhere
first does not. Settings and model parameters that look like figures are listed, with why.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
NUMBER = r"\d+(?:[.,]\d+)*"
# A number and its unit, or a range of them (`0.59x-0.99x`, `1.3–1.5 ms`): both ends.
FIGURE = re.compile(rf"(?:({NUMBER})[x×]?\s?[–-]\s?)?({NUMBER})(?:\s*[x×]|\s?(?:ms|µs|GiB/s|MiB/s|GB/s)\b)")
NOT_MEASURED = {
    ("docs/CLUSTER.md", "0.2"): "the routing simulation's cost model: a block fetched in 0.2 ms",
    ("docs/guide.md", "250"): "behaviour, not a measurement: writes yield to a restore seen in the last 250 ms",
}


def figures(text: str) -> set[str]:
    return {number for found in FIGURE.findall(re.sub(r"\s+", " ", text)) for number in found if number}


def unlisted(document: Path, benchmarks: str) -> list[str]:
    """The figures `document` quotes that benchmarks.md lacks and NOT_MEASURED does not explain."""
    numbers = set(re.findall(NUMBER, benchmarks))
    name = document.relative_to(ROOT).as_posix()
    return sorted(figure for figure in figures(document.read_text())
                  if figure not in numbers and (name, figure) not in NOT_MEASURED)


def test_every_figure_quoted_is_on_the_benchmarks_page():
    benchmarks = BENCHMARKS.read_text()
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {document.name: unlisted(document, benchmarks) for document in documents if document != BENCHMARKS}
    assert {name: found for name, found in missing.items() if found} == {}
    for (name, figure), why in NOT_MEASURED.items():
        assert figure in figures((ROOT / name).read_text()), f"{name} no longer quotes {figure} ({why}): drop it"


def test_the_check_finds_figures_in_their_forms(tmp_path):
    quoted = tmp_path / "page.md"
    quoted.write_text("ran at 2.53 GiB/s,\n0.89× the READ and 1.26-1.31x; 24.4 ms (12.2x), 9.1 µs, 12 MiB/s")
    assert figures(quoted.read_text()) == {"2.53", "0.89", "1.26", "1.31", "24.4", "12.2", "9.1", "12"}
    assert figures("0.59x-0.99x, 1.3–1.5 ms, 2026-11-28") == {"0.59", "0.99", "1.3", "1.5"}
    assert unlisted(ROOT / "README.md", "") != []
