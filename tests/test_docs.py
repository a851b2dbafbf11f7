"""The documentation stays true to the code: the configuration page is the generator's
output, every config field is documented, and every relative link in README.md,
docs/ and benchmarks/ points at a file (and heading) that exists. Pure text, no Ray."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raytrain_platform.config.docs import field_docs, render, undocumented

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "benchmarks" / "results").glob("*.md")])
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_the_configuration_page_is_the_generators_output():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), ("docs/configuration.md is stale: run "
                              "`python -m raytrain_platform.config.docs > docs/configuration.md`")


def test_every_config_field_has_a_docstring():
    assert undocumented() == [], "document each field with a string right below it (config/*_section.py, sections.py)"


def test_field_docs_reads_only_the_string_below_a_field():
    docs = field_docs()
    assert docs["RunConfig"]["name"].startswith("The run directory's name")
    # Class-level constants and methods carry no field docs.
    assert "SECTION" not in docs["RunConfig"] and "_ALLOWED" not in docs["DataConfig"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_FENCE.sub("", path.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(page):
    assert page.exists()
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading #{anchor} in {path.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n[ok](#top) [bad](missing.md) [a](p.md#nowhere)\n```\n[in code](x.md)\n```\n")
    assert _links(page) == ["#top", "missing.md", "p.md#nowhere"]
    assert _anchors(page) == {"top"}
    assert _slug("LoRA fine-tuning (`model.lora`)") == "lora-fine-tuning-modellora"


def test_the_readme_runs_what_ci_runs():
    """.ci/run installs and tests with the README's own commands, letter for letter."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install = next(line for line in ci if "pip install" in line and " -e " in line)
    test = next(line for line in ci if "pytest" in line)
    readme = (ROOT / "README.md").read_text()
    assert test == "python -m pytest -q tests"
    assert install in readme and f"&& {test}\n" in readme, (install, test)


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
