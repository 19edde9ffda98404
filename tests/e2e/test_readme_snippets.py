"""The Python snippets of the README and the getting-started page run as written against a server started as
`make serve` starts one (no --model: the bundled all-MiniLM-L6-v2; HTTP and metrics on), with only the
addresses changed."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.helpers.inprocess import in_process_server
from tests.helpers.server import REPO_ROOT, free_port

README = "README.md"
GETTING_STARTED = "docs/getting-started.md"
SNIPPETS = [
    (README, "### gRPC, with embedserv-client"),
    (README, "### gRPC, with the generated stubs"),
    (README, "### The openai SDK"),
    (README, "### Cohere (and Jina, vLLM) rerank"),
    (README, "### TEI's HTTP API"),
    (GETTING_STARTED, "### Python, with embedserv-client"),
    (GETTING_STARTED, "### Python, with the generated stubs"),
]


def _first_python_block(path: str, section: str) -> str:
    text = (REPO_ROOT / path).read_text()
    after = text[text.index(section) :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.fixture(scope="module")
def server():
    http_port = free_port()
    with in_process_server(["--http-port", str(http_port), "--metrics-port", str(free_port())]) as (address, _):
        yield address, http_port


@pytest.mark.parametrize("path, section", SNIPPETS, ids=[f"{p}:{s.lstrip('# ')}" for p, s in SNIPPETS])
def test_snippet_runs_against_make_serves_server(server, path, section, capsys, monkeypatch):
    address, http_port = server
    # The suite runs with the hub offline; huggingface_hub's client then refuses any URL, this server's included.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    code = _first_python_block(path, section)
    assert "127.0.0.1:50051" in code or "127.0.0.1:8000" in code
    code = code.replace("127.0.0.1:50051", address).replace("127.0.0.1:8000", f"127.0.0.1:{http_port}")
    names: dict = {}
    exec(compile(code, f"{path} {section}", "exec"), names)
    if "embedserv-client" in section:
        assert names["vectors"].shape == (2, 384)
        assert [r.index for r in names["best"]] == [0]
        assert names["tokens"][0].special
    elif "generated stubs" in section:
        assert "(2, 384)" in capsys.readouterr().out
    elif "openai" in section:
        assert [len(v) for v in names["vectors"]] == [384, 384]
    elif "Cohere" in section:
        assert capsys.readouterr().out.startswith("0 ")
    else:
        assert np.asarray(names["vectors"]).shape == (2, 384)
