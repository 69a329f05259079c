"""make readme (shared.report.update_readme): the generated tables live in docs/ pages now (issue #42)."""
from pathlib import Path

from shared import report
from shared.results import ROOT


def test_marked_files_are_the_docs_pages_that_hold_the_tables():
    found = [p.relative_to(ROOT).as_posix() for p in report.marked_files()]
    assert found == ["docs/decoder-checks.md", "docs/results.md"]
    readme = (ROOT / "README.md").read_text()
    assert "<!-- RESULTS -->" not in readme and "<!-- FUZZ -->" not in readme
    for page in found:  # the front page links every docs page that holds generated tables
        assert f"]({page})" in readme


def test_update_readme_rewrites_the_blocks_of_a_given_file(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- RESULTS -->\nOLD_TABLE_0xDEAD\n<!-- /RESULTS -->\nmiddle\n<!-- FUZZ -->\nOLD_TABLE_0xDEAD\n<!-- /FUZZ -->\nafter\n")
    assert report.update_readme(page) == [page]
    text = page.read_text()
    assert "OLD_TABLE_0xDEAD" not in text
    assert f"<!-- RESULTS -->\n{report.render()}\n<!-- /RESULTS -->" in text
    fuzz = report.fuzz_summary()
    if fuzz:
        assert f"<!-- FUZZ -->\n{fuzz}\n<!-- /FUZZ -->" in text
    assert text.startswith("before\n") and "\nmiddle\n" in text and text.endswith("after\n")
    assert report.update_readme(page) == []  # a second run changes nothing


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in readme, page.name
    assert len(readme.splitlines()) <= 250
