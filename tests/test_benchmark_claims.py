"""The results page and the user docs agree: every figure README.md and docs/*.md cite from a benchmark is on
BENCHMARKS.md or in its history (docs/benchmarks/), every section they name is a heading there, the page's
links and commands lead somewhere, and it stays a page."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "BENCHMARKS.md"
HISTORY = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: a passage that cites the benchmarks (a paragraph or a list item)
CITES = re.compile(r"BENCHMARKS\.md|\bbenchmark", re.IGNORECASE)
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
#: a figure: a percentage or multiple (ranges too), a decimal of 2 places or more, a memory size, "N of M"
FIGURE = re.compile(
    rf"{_NUMBER}(?:\s*[-–]\s*{_NUMBER})?\s*(?:%|×|x\b)"
    rf"|\b\d+\.\d{{2,}}\b"
    rf"|{_NUMBER}\s*(?:GB|GiB|MiB)\b"
    rf"|\b\d+ of \d+\b"
)


def normal(text: str) -> str:
    """One spelling for what the pages write several ways: dashes, minus, ×, spaces before % and units."""
    text = text.replace("–", "-").replace("—", "-").replace("−", "-").replace("×", "x")
    text = re.sub(r"(\d)\s+(%|x\b|GB|GiB|MiB)", r"\1\2", text)
    text = re.sub(r"\s*-\s*(?=\d)", "-", text)
    return " ".join(text.split())


def passages(text: str) -> list[str]:
    """Paragraphs and list items, each on one line (code blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    out = []
    for block in re.split(r"\n\s*\n", text):
        out += [" ".join(item.split()) for item in re.split(r"\n(?=\s*[*-] )", block) if item.strip()]
    return out


def cited_figures() -> dict[str, list[str]]:
    """Each figure a user page cites in a passage about the benchmarks -> where (page: passage start)."""
    found: dict[str, list[str]] = {}
    for page in USER_PAGES:
        for passage in passages(page.read_text()):
            if CITES.search(passage):
                for match in FIGURE.finditer(passage):
                    found.setdefault(normal(match.group(0)), []).append(f"{page.name}: {passage}")
    return found


#: figures the user docs compute themselves (a formula applied to a size), not measurements: figure -> why
DERIVED = {
    "2.4GB": "scoring.md: the projection Gram's memory per layer of a large model, by its formula",
    "4.8MiB": "scoring.md: the greedy expert sample's memory at E = 16, by its formula",
    "21MiB": "scoring.md: the same at E = 256",
}


def headings() -> list[str]:
    return [
        " ".join(line.lstrip("#").split())
        for p in [RESULTS, *HISTORY]
        for line in p.read_text().splitlines()
        if line.startswith("##")
    ]


def test_every_figure_the_docs_cite_is_on_the_results_page_or_in_the_history_they_point_to():
    figures = cited_figures()
    assert len(figures) >= 15  # the extraction finds the docs' figures (it can fail)
    results = normal(RESULTS.read_text())
    history = normal("\n".join(p.read_text() for p in HISTORY))
    missing = {
        figure: where
        for figure, where in figures.items()
        if figure not in results
        and figure not in DERIVED
        and not (figure in history and all("docs/benchmarks/" in w for w in where))
    }
    assert missing == {}


def test_every_section_the_docs_name_is_a_heading_of_the_results_page_or_its_history():
    names = []
    for page in USER_PAGES:
        text = " ".join(page.read_text().split())
        names += re.findall(r"(?:BENCHMARKS\.md|docs/benchmarks/\w[\w-]*\.md)\)?,? \(?\"([^\"]+)\"", text)
        names += re.findall(r"BENCHMARKS\.md \(\"([^\"]+)\"\)", text)
    assert len(names) >= 5, names
    known = headings()
    assert [n for n in names if not any(h.startswith(n) for h in known)] == []


def test_the_results_page_is_a_page_whose_links_and_commands_lead_somewhere():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 400
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), target
    sys.path.insert(0, str(ROOT))
    from benchmarks.__main__ import suites

    scripts = suites()
    for name, part in re.findall(r"python -m benchmarks ([a-z_]+)(?: ([a-z_]+))?", " ".join(text.split())):
        assert name in scripts, name
        source = (ROOT / "benchmarks" / f"{name}.py").read_text()
        parts = set(re.findall(r"add_parser\(\s*\"(\w+)\"", source))
        parts |= set(re.findall(r"\"(\w+)\": \w+", (re.findall(r"PARTS = \{[^}]*\}", source) or [""])[0]))
        if parts:
            assert part in parts, (name, part, parts)
    for section in re.split(r"\n## ", text)[1:]:  # one claim each: a command and a date
        assert re.search(r"python (-m benchmarks|scripts/\w+\.py)|benchmarks/\w+\.py`? of \w+", section), (
            section[:60]
        )
        assert re.search(r"20\d\d-\d\d-\d\d", section), section[:60]
