"""The production flags: their validation, the derived message limit, the API key's sources, JSON logs,
and the in-flight limiter."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import pytest

from embedserv.cli import build_parser, server_config
from embedserv.config import ModelConfig, ServerConfig
from embedserv.errors import ConfigError, Overloaded
from embedserv.logs import REQUEST_ID, JsonFormatter
from embedserv.server.frontend import InflightLimiter
from embedserv.server.frontend_server import server_options

MODEL = (ModelConfig(path="/models/m", served_name="m"),)


@pytest.mark.parametrize(
    "fields, flag",
    [
        (dict(tls_cert="c.pem"), "--tls-key"),
        (dict(tls_key="k.pem"), "--tls-cert"),
        (dict(tls_client_ca="ca.pem"), "--tls-client-ca"),
        (dict(api_key="  "), "API key"),
        (dict(drain_timeout=-1), "--drain-timeout"),
        (dict(metrics_port=70000), "--metrics-port"),
        (dict(max_input_chars=0), "--max-input-chars"),
        (dict(max_connection_age=0), "--max-connection-age"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(models=MODEL, **fields)


def test_receive_limit_fits_a_full_call_of_the_longest_inputs():
    image_model = (dataclasses.replace(MODEL[0], max_image_bytes=3000),)
    config = ServerConfig(models=image_model, max_client_batch_size=8, max_input_chars=1000, max_images_per_request=3)
    # 8 inputs and a rerank query of 1000 four-byte characters each; a text-only server adds nothing for images.
    assert 9 * 4000 <= config.receive_limit(images=False) < 9 * 4000 + 128 * 1024
    # A server with a model that takes images: also 3 images at the byte limit, base64 on HTTP.
    assert 9 * 4000 + 3 * 4000 <= config.receive_limit(images=True) < 9 * 4000 + 3 * 4000 + 128 * 1024
    huge = ServerConfig(
        models=MODEL, max_client_batch_size=100_000, max_concurrent_requests=100_000, max_input_chars=10**7
    )
    assert huge.receive_limit(images=False) == 2**31 - 1


def test_the_api_key_is_kept_out_of_the_config_repr():
    assert "secret-key" not in repr(ServerConfig(models=MODEL, api_key="secret-key"))


def _config(argv: list[str]) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", "--model", "/models/m", *argv]))


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv("EMBEDSERV_API_KEY", raising=False)
    assert _config([]).api_key is None
    monkeypatch.setenv("EMBEDSERV_API_KEY", "from-env")
    assert _config([]).api_key == "from-env"
    assert _config(["--api-key", "from-flag"]).api_key == "from-flag"
    monkeypatch.setenv("EMBEDSERV_API_KEY", "")
    assert _config([]).api_key is None


def test_production_flags_reach_the_config():
    config = _config([
        "--max-input-chars", "123", "--drain-timeout", "7.5", "--metrics-port", "9100",
        "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem", "--allow-pickle",
    ])  # fmt: skip
    assert (config.max_input_chars, config.drain_timeout, config.metrics_port) == (123, 7.5, 9100)
    assert (config.tls_cert, config.tls_key, config.tls_client_ca) == ("c.pem", "k.pem", "ca.pem")
    assert config.models[0].allow_pickle


def _serve_parser() -> argparse.ArgumentParser:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["serve"]


# Flags that are config fields but not named after them.
_FIELD_OF_FLAG = {"model": "path", "served_model_name": "served_name"}


def test_flag_defaults_are_the_dataclass_defaults():
    """Defaults live in the dataclasses: a flag's own default is None (taken from there) or equal to it."""
    fields = {f.name: (cls, f) for cls in (ModelConfig, ServerConfig) for f in dataclasses.fields(cls)}
    covered = set()
    for action in _serve_parser()._actions:
        name = _FIELD_OF_FLAG.get(action.dest, action.dest)
        if name not in fields:
            continue
        covered.add(name)
        cls, field = fields[name]
        if action.default is not None:
            assert action.default == field.default, (
                f"{action.option_strings[0]} {action.default!r} != {cls.__name__}.{name}"
            )
        if field.default not in (dataclasses.MISSING, None) and action.help:
            assert f"(default: {field.default})" in action.help, action.option_strings[0]
    # Every field can be set by a flag (and so, by the same name with _, in a --config file).
    assert covered == set(fields) - {"models"}


def test_no_flags_give_the_dataclass_defaults(monkeypatch):
    monkeypatch.delenv("EMBEDSERV_API_KEY", raising=False)
    assert _config([]) == ServerConfig(models=(ModelConfig(path="/models/m", served_name="m"),))


def test_max_connection_age_becomes_the_grpc_option_only_when_set():
    assert "grpc.max_connection_age_ms" not in dict(server_options(_config([]), 1024))
    options = dict(server_options(_config(["--max-connection-age", "2.5"]), 1024))
    assert options["grpc.max_connection_age_ms"] == 2500
    # No grace option: a call in flight on a closing connection runs to its end.
    assert "grpc.max_connection_age_grace_ms" not in options


def _record(message: str, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("embedserv.test", logging.INFO, __file__, 1, message, (), exc_info)


def test_json_lines_carry_the_request_id_and_extra_fields():
    formatter = JsonFormatter({"worker": "m/0"})
    token = REQUEST_ID.set("req-42")
    try:
        entry = json.loads(formatter.format(_record("batch of 3 sequences")))
    finally:
        REQUEST_ID.reset(token)
    assert entry["message"] == "batch of 3 sequences"
    assert (entry["level"], entry["logger"], entry["request_id"], entry["worker"]) == (
        "info",
        "embedserv.test",
        "req-42",
        "m/0",
    )
    assert entry["time"].endswith("Z")
    assert "request_id" not in json.loads(formatter.format(_record("outside a call")))


def test_json_lines_carry_exceptions_on_one_line():
    try:
        raise ValueError("bad thing")
    except ValueError:
        import sys

        line = JsonFormatter().format(_record("failed", sys.exc_info()))
    assert "\n" not in line
    assert "ValueError: bad thing" in json.loads(line)["exception"]


def test_the_limiter_counts_inputs_and_refuses_past_the_limit():
    limiter = InflightLimiter(10)
    with limiter.hold(8):
        assert limiter.in_flight == 8
        with pytest.raises(Overloaded, match="limit of 10 inputs in flight"):
            with limiter.hold(3):
                pass
        with limiter.hold(2):
            assert limiter.in_flight == 10
    assert limiter.in_flight == 0
