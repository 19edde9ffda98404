"""Named API keys: parsing and checks, which key a call carries, and each tenant's share of admission."""

from __future__ import annotations

import multiprocessing

import pytest

from embedserv.api_keys import ApiKey, KeyTable, api_keys_of, read_api_keys_file
from embedserv.call_class import CALL_CLASS, CallClass
from embedserv.cli import build_parser, server_config
from embedserv.errors import ConfigError, Overloaded
from embedserv.server.frontend import InflightLimiter

KEYS = [
    {"name": "search", "key": "k-search", "priority": 10},
    {"name": "indexer", "key": "k-index", "priority": -1, "max_share": 0.25},
    {"name": "other", "key": "k-other"},
]


def test_keys_parse_with_their_defaults_and_caps():
    keys = api_keys_of(KEYS, "test")
    assert keys[0] == ApiKey("search", "k-search", 10, None)
    assert "k-search" not in repr(keys[0])
    # Several keys: half the limit each unless a key says its share.
    assert KeyTable(keys, 100).caps == {"search": 50, "indexer": 25, "other": 50}
    assert KeyTable(keys[:1], 100).caps == {"search": 100}


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "non-empty list"),
        ([{"name": "a"}], "name and key"),
        ([{"name": "a", "key": "x", "color": 1}], "name and key"),
        ([{"name": "a", "key": " "}], "non-empty strings"),
        ([{"name": "a", "key": "x", "priority": "high"}], "priority must be an integer"),
        ([{"name": "a", "key": "x", "max_share": 0}], "max_share must be a number in"),
        ([{"name": "a", "key": "x"}, {"name": "a", "key": "y"}], "its own name; repeated: a"),
        ([{"name": "a", "key": "x"}, {"name": "b", "key": "x"}], "its own key"),
    ],
)
def test_bad_entries_are_refused_saying_what_to_fix(entries, message):
    with pytest.raises(ConfigError, match=message):
        api_keys_of(entries, "test")


def test_match_names_the_key_or_what_is_wrong():
    table = KeyTable(api_keys_of(KEYS, "test"), 100)
    assert table.match("Bearer k-index", "header") == (table.keys[1], None)
    assert table.match(None, "header")[1].startswith("this server needs an API key")
    assert "must read 'Bearer <key>'" in table.match("Basic k-index", "header")[1]
    assert "the API key is wrong" in table.match("Bearer nope", "metadata")[1]


def test_the_file_flag_and_the_single_key_together(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("- {name: search, key: k1, priority: 5}\n- {name: bulk, key: k2, max_share: 0.5}\n")
    args = build_parser().parse_args(["serve", "--api-keys-file", str(path), "--api-key", "k0"])
    config = server_config(args)
    assert [k.name for k in config.all_api_keys] == ["default", "search", "bulk"]
    path.write_text("- {name: search, key: k0}\n")
    with pytest.raises(ConfigError, match="its own key"):
        server_config(build_parser().parse_args(["serve", "--api-keys-file", str(path), "--api-key", "k0"]))
    with pytest.raises(ConfigError, match="cannot read it"):
        read_api_keys_file(str(tmp_path / "missing.yaml"))


def _as(tenant: str) -> None:
    CALL_CLASS.set(CallClass(None, tenant))


def test_one_tenants_burst_cannot_take_every_slot():
    shared = multiprocessing.get_context("spawn").Array("q", 3)
    # Two front ends share the counts: the caps hold for the whole server.
    first = InflightLimiter(100, shared, {"search": 50, "indexer": 25})
    second = InflightLimiter(100, shared, {"search": 50, "indexer": 25})
    _as("indexer")
    with first.hold(20):
        with pytest.raises(Overloaded, match="this API key's calls are at their share of 25 inputs in flight"):
            with second.hold(10):
                pass
        _as("search")
        with second.hold(50):
            assert first.in_flight == 70 and list(shared) == [70, 50, 20]
            with pytest.raises(Overloaded, match="share of 50"):
                with first.hold(1):
                    pass
        # A call without a named key (or a key without a cap) counts against the server's limit only.
        _as("")
        with first.hold(80):
            assert second.in_flight == 100
    assert list(shared) == [0, 0, 0]
