"""The docs site: its generated pages are what their scripts write (docs/reference.py, benchmarks/performance_page.py),
the configuration page names every flag and key, and `mkdocs build --strict` passes (no broken link or anchor, no
page outside the nav)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return _script("docs/reference.py")


@pytest.fixture(scope="module")
def performance():
    return _script("benchmarks/performance_page.py")


def test_the_reference_pages_are_current(reference):
    for relative, render in reference.PAGES.items():
        assert (ROOT / "docs" / relative).read_text() == render(), f"docs/{relative} is stale: run `make docs`"


def test_the_configuration_page_names_every_flag_and_key(reference):
    from embedserv.config_file import MODEL_KEYS, SERVER_KEYS

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    flags = [name for action in reference.serve_actions() for name in action.option_strings]
    assert len(flags) > 40
    assert [flag for flag in flags if f"`{flag}`" not in page] == []
    assert [key for key in (*SERVER_KEYS, *MODEL_KEYS) if f"`{key}`" not in page and f" {key}`" not in page] == []


def test_a_flag_missing_from_the_page_is_caught(reference, monkeypatch):
    """The check above can fail: a flag added to the parser and not to the page is missing from it."""
    from embedserv import cli

    build = cli.build_parser

    def with_a_new_flag():
        parser = build()
        serve = next(a for a in parser._actions if hasattr(a, "choices") and a.choices and "serve" in a.choices)
        serve.choices["serve"].add_argument("--a-new-flag", help="new")
        return parser

    monkeypatch.setattr(cli, "build_parser", with_a_new_flag)
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert reference.configuration_page() != page and "`--a-new-flag`" not in page


def test_the_performance_page_and_the_readme_table_are_current(performance):
    runs = performance.load_results()
    assert runs, "no results files in benchmarks/results/"
    assert (ROOT / "docs" / "PERFORMANCE.md").read_text() == performance.render(runs), (
        "docs/PERFORMANCE.md is stale: run `make docs`"
    )
    readme = (ROOT / "README.md").read_text()
    assert performance.with_readme_block(readme, runs) == readme, "README.md's performance table is stale: `make docs`"


def test_every_results_file_says_how_it_was_made_and_every_chart_is_drawn(performance, tmp_path):
    runs = performance.load_results()
    for stem, run in runs:
        assert run["command"].startswith("python benchmarks/") and run["cpu"] and run["date"] and run["commit"], stem
        assert all(row["tokens_per_s"] > 0 for row in run["rows"]), stem
        assert any(row["system"] == performance.OURS for row in run["rows"]), stem
        assert (ROOT / "docs" / "assets" / "performance" / f"{stem}.png").exists(), f"{stem}.png: run `make docs`"
    stem, run = runs[0]
    assert performance.draw(stem, run, tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert performance.draw_standing(runs, tmp_path).exists()
    assert (ROOT / "docs" / "assets" / "performance" / "standing.png").exists()


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
