"""The HTTP faces' answers to malformed calls, before any model runs (FastAPI's TestClient on build_app): a body
that is no JSON says where, a body without a JSON content type gets 415 saying which to send, a field of
several shapes names them in one sentence, /v1/embeddings refuses strings for numbers and booleans and
unknown fields (not the ones the openai SDK sends), and every 429 and 503 carries Retry-After."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from embedserv.errors import NotReady, Overloaded
from embedserv.server.http.app import build_app

JSON_TYPE = {"content-type": "application/json"}


class _Overloaded:
    """A Frontend whose every model choice is refused for load."""

    def engine_for(self, *names):
        raise Overloaded("server is at its limit of 1 inputs in flight (1 now); retry with backoff")

    @property
    def models(self):
        return SimpleNamespace(get=self.engine_for)


class _NotReady(_Overloaded):
    def engine_for(self, *names):
        raise NotReady("model m is not serving yet; retry shortly")


@pytest.fixture(scope="module")
def client():
    return TestClient(build_app(None), raise_server_exceptions=False)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed"])
def test_malformed_json_says_where_and_names_no_param(client, path):
    reply = client.post(path, content=b'{"input": "a",\n  ,}', headers=JSON_TYPE)
    assert reply.status_code == (400 if path.startswith("/v1") else 422), reply.text
    message = reply.text
    assert "not valid JSON" in message and "line 2, column 3" in message and "JSON decode error" not in message
    if path.startswith("/v1"):
        assert reply.json()["error"]["param"] is None


def test_an_empty_body_says_so(client):
    reply = client.post("/v1/embeddings", content=b"", headers=JSON_TYPE)
    assert reply.status_code == 400 and "the body is empty; send a JSON object" in reply.json()["error"]["message"]


NOT_JSON = [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}]


@pytest.mark.parametrize("headers", NOT_JSON)
@pytest.mark.parametrize("path", ["/v1/embeddings", "/embed"])
def test_a_body_without_json_content_type_is_415_naming_it(client, path, headers):
    reply = client.post(path, content=b'{"input": "a", "inputs": "a"}', headers=headers)
    assert reply.status_code == 415, reply.text
    assert "Content-Type: application/json" in reply.text


def test_input_of_no_accepted_shape_is_one_sentence(client):
    reply = client.post("/v1/embeddings", json={"input": 42})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "input"
    assert error["message"].endswith(
        "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    )


def test_a_field_of_an_inputs_object_is_named_not_taken_for_a_shape(client):
    """/similarity's inputs is an object: its missing field is named, not inputs' shapes of /embed."""
    reply = client.post("/similarity", json={"inputs": {"sentences": ["b"]}})
    assert (
        reply.status_code == 422 and reply.json()["error"] == "invalid request: inputs.source_sentence: Field required"
    )


@pytest.mark.parametrize("field, value", [("dimensions", "64"), ("normalize", "true"), ("truncate", 1)])
def test_openai_numbers_and_booleans_are_strict(client, field, value):
    reply = client.post("/v1/embeddings", json={"input": "a", field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def test_openai_unknown_fields_are_refused_by_name(client):
    reply = client.post("/v1/embeddings", json={"input": "a", "temperatur": 1})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "temperatur" and "unrecognized request argument 'temperatur'" in error["message"]


def test_what_the_openai_sdk_sends_passes_validation():
    # The refusal comes from the model choice, after the body was accepted.
    client = TestClient(build_app(_Overloaded()), raise_server_exceptions=False)
    body = {"input": ["a"], "model": "m", "dimensions": 8, "encoding_format": "base64", "user": "u"}
    assert client.post("/v1/embeddings", json=body).status_code == 429


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": "a"}), ("/embed", {"inputs": "a"})])
def test_every_429_says_when_to_retry(path, body):
    client = TestClient(build_app(_Overloaded()), raise_server_exceptions=False)
    reply = client.post(path, json=body)
    assert reply.status_code == 429
    assert int(reply.headers["retry-after"]) >= 1


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": "a"}), ("/embed", {"inputs": "a"})])
def test_every_503_says_when_to_retry(path, body):
    client = TestClient(build_app(_NotReady()), raise_server_exceptions=False)
    reply = client.post(path, json=body)
    assert reply.status_code == 503
    assert int(reply.headers["retry-after"]) >= 1
