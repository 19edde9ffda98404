"""tests/helpers/fake_dns.py: its wire format, and gRPC's c-ares resolver using it as the DNS server
named in a ``dns://127.0.0.1:DNSPORT/embedserv.test:P`` target, so that ``round_robin`` spreads calls
over two servers behind one name (127.0.0.1:P and 127.0.0.2:P), as with a Kubernetes headless Service."""

from __future__ import annotations

import collections
import json
import os
import socket
import struct
import sys
from concurrent import futures

import grpc
import pytest

from tests.helpers.fake_dns import FakeDns

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="needs all of 127.0.0.0/8 on loopback (Linux)"),
    pytest.mark.skipif(
        os.environ.get("GRPC_DNS_RESOLVER", "ares").lower() != "ares",
        reason="only gRPC's c-ares resolver honours a dns://AUTHORITY/ (native uses getaddrinfo)",
    ),
]

NAME = "embedserv.test"
ADDRS = ["127.0.0.1", "127.0.0.2"]
METHOD = "/fakedns.Who/Am"


# --- the DNS wire format, over plain sockets ------------------------------------------------------


def _query(name: str, qtype: int, qid: int) -> bytes:
    """A recursion-desired query for (name, qtype, IN), with an EDNS OPT record as c-ares sends."""
    qname = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    opt = b"\0" + struct.pack("!HHIH", 41, 1232, 0, 0)  # root name, type OPT, UDP size, flags, no data
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 1) + qname + struct.pack("!HH", qtype, 1) + opt


def _ask(port: int, query: bytes, transport: str) -> bytes:
    if transport == "udp":
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(5)
            sock.sendto(query, ("127.0.0.1", port))
            return sock.recv(65535)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(struct.pack("!H", len(query)) + query)
        with sock.makefile("rb") as stream:
            return stream.read(struct.unpack("!H", stream.read(2))[0])


def _parse(reply: bytes, query: bytes) -> tuple[int, int, list[str]]:
    """(id, flags, A addresses) of a reply; checks it echoes the query's question."""
    qid, flags, qdcount, ancount, _, _ = struct.unpack_from("!HHHHHH", reply)
    question_end = query.index(b"\0", 12) + 5
    assert qdcount == 1 and reply[12:question_end] == query[12:question_end]
    addrs, pos = [], question_end
    for _ in range(ancount):
        ptr, rtype, rclass, ttl, rdlen = struct.unpack_from("!HHHIH", reply, pos)
        assert (ptr, rtype, rclass, rdlen) == (0xC00C, 1, 1, 4) and ttl > 0
        addrs.append(socket.inet_ntoa(reply[pos + 12 : pos + 16]))
        pos += 12 + rdlen
    assert pos == len(reply)
    return qid, flags, addrs


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_wire_format(transport):
    with FakeDns({NAME: ADDRS}) as dns:
        for qid, (name, qtype, rcode, expected) in enumerate(
            [
                (NAME, 1, 0, ADDRS),  # A: every address
                ("EmbedServ.Test", 1, 0, ADDRS),  # names are case-insensitive; the question is echoed as asked
                (NAME, 28, 0, []),  # AAAA: NOERROR, no answers
                ("nosuch.test", 1, 3, []),  # NXDOMAIN
            ],
            start=100,
        ):
            query = _query(name, qtype, qid)
            got_id, flags, addrs = _parse(_ask(dns.port, query, transport), query)
            assert got_id == qid and addrs == expected
            assert flags & 0x8000 and flags & 0x0100 and flags & 0x0080, "QR, RD (copied) and RA"
            assert flags & 0x000F == rcode
        assert dns.queries == {(NAME, "A"): 2, (NAME, "AAAA"): 1, ("nosuch.test", "A"): 1}
        assert dns.transports == {transport: 4}


# --- gRPC: one name, two servers -----------------------------------------------------------------


def _start(addr: str, port: int, hits: collections.Counter) -> tuple[grpc.Server, int] | None:
    """A server on addr:port (0: any) whose one method records the call and answers its own address."""

    def who_am_i(request, context):
        hits[addr] += 1
        return addr.encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("fakedns.Who", {"Am": grpc.unary_unary_rpc_method_handler(who_am_i)})]
    )
    try:
        bound = server.add_insecure_port(f"{addr}:{port}")
    except RuntimeError:  # "Failed to bind ..."
        bound = 0
    if not bound:
        server.stop(None)
        return None
    server.start()
    return server, bound


@pytest.fixture
def servers():
    """Two servers on 127.0.0.1:P and 127.0.0.2:P (same port); yields (P, calls per address)."""
    hits: collections.Counter = collections.Counter()
    started: list[grpc.Server] = []
    try:
        for _ in range(5):  # P is free on 127.0.0.1; retry if it happens to be taken on 127.0.0.2
            first = _start(ADDRS[0], 0, hits)
            assert first is not None, "cannot bind 127.0.0.1:0"
            port = first[1]
            second = _start(ADDRS[1], port, hits)
            if second is not None:
                started += [first[0], second[0]]
                break
            first[0].stop(None)
        else:
            pytest.skip(f"cannot bind {ADDRS[1]} on a port free on {ADDRS[0]}")
        yield port, hits
    finally:
        for server in started:
            server.stop(None)


def _channel(target: str, lb_policy: str | None) -> grpc.Channel:
    options = []
    if lb_policy is not None:
        options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{lb_policy: {}}]})))
    return grpc.insecure_channel(target, options=options)


def _call_20(target: str, lb_policy: str | None) -> list[str]:
    """Which server answered each of 20 calls."""
    with _channel(target, lb_policy) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        who = channel.unary_unary(METHOD)
        return [who(b"", timeout=5).decode() for _ in range(20)]


@pytest.mark.parametrize("force_tcp", [False, True], ids=["udp", "tcp"])
def test_round_robin_spreads_calls_over_one_name(servers, force_tcp):
    port, hits = servers
    with FakeDns({NAME: ADDRS}, force_tcp=force_tcp) as dns:
        answered_by = _call_20(f"dns://127.0.0.1:{dns.port}/{NAME}:{port}", "round_robin")
        assert dns.queries[(NAME, "A")] >= 1, "the resolver did not ask the fake DNS"
        if force_tcp:
            assert dns.transports["tcp"] >= 1, "c-ares did not retry a truncated reply over TCP"
    assert set(answered_by) == set(ADDRS)
    assert hits == collections.Counter(answered_by)
    assert min(hits.values()) >= 5, f"round_robin should be about even: {hits}"


@pytest.mark.parametrize("lb_policy", ["pick_first", None], ids=["pick_first", "no_service_config"])
def test_pick_first_sends_every_call_to_one_server(servers, lb_policy):
    port, hits = servers
    with FakeDns({NAME: ADDRS}) as dns:
        answered_by = _call_20(f"dns://127.0.0.1:{dns.port}/{NAME}:{port}", lb_policy)
        assert dns.queries[(NAME, "A")] >= 1
    assert len(set(answered_by)) == 1 and sum(hits.values()) == 20, hits


def test_unknown_name_is_unavailable():
    with FakeDns({NAME: ADDRS}) as dns:
        with _channel(f"dns://127.0.0.1:{dns.port}/nosuch.test:1", "round_robin") as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(METHOD)(b"", timeout=5)
        assert dns.queries[("nosuch.test", "A")] >= 1
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "nosuch.test" in err.value.details()
