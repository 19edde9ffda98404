"""The README's Python snippets under "Calling it" run as written against a server started as `make serve` starts
one (no --model: the bundled all-MiniLM-L6-v2; HTTP and metrics on), with only the address changed."""

from __future__ import annotations

import re

import pytest

from tests.helpers.inprocess import in_process_server
from tests.helpers.server import REPO_ROOT, free_port

SECTIONS = ["### Python, with embedserv-client", "### Python, with the generated stubs"]


def _first_python_block(section: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    after = readme[readme.index(section) :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.fixture(scope="module")
def target():
    args = ["--http-port", str(free_port()), "--metrics-port", str(free_port())]
    with in_process_server(args) as (address, _handle):
        yield address


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_snippet_runs_against_make_serves_server(target, section, capsys):
    code = _first_python_block(section)
    assert "127.0.0.1:50051" in code
    names: dict = {}
    exec(compile(code.replace("127.0.0.1:50051", target), f"README {section}", "exec"), names)
    if section == SECTIONS[0]:
        assert names["vectors"].shape == (2, 384)
        assert [r.index for r in names["best"]] == [0]
        assert names["tokens"][0].special
    else:
        assert "(2, 384)" in capsys.readouterr().out
