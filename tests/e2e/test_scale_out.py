"""Scale-out as on Kubernetes: two replicas behind one DNS name, the client balancing round robin.

A headless Service is one name that resolves to every ready pod's IP, all on the same port. Here two real
servers listen on 127.0.0.1:P and 127.0.0.2:P (all of 127/8 is loopback on Linux), and a fake DNS server
(tests/helpers/fake_dns.py) answers `embedserv.test` with both addresses; gRPC's resolver asks it through
the target's authority, `dns://127.0.0.1:DNSPORT/embedserv.test:P`. Each replica's /metrics shows the
calls it received. A replica added behind the name is found once connections age out
(--max-connection-age); when one replica stops, calls keep succeeding on the other."""

from __future__ import annotations

import contextlib
import socket
import time

import grpc
import numpy as np
import pytest

from embedserv_client import Client, RetryPolicy
from tests.helpers.fake_dns import FakeDns
from tests.helpers.metrics import scrape
from tests.helpers.server import free_port, running_server, stop_process

NAME = "embedserv.test"
HOSTS = ("127.0.0.1", "127.0.0.2")
TEXTS = [f"replica test sentence {i}" for i in range(24)]


def port_free_on_both() -> int:
    """One port that nothing listens on at 127.0.0.1 or 127.0.0.2."""
    for _ in range(20):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind((HOSTS[1], port))
            except OSError:
                continue
        return port
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


@pytest.fixture(scope="module")
def replicas(bundled_dir):
    port = port_free_on_both()
    metrics_ports = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        procs = []
        for host, metrics_port in zip(HOSTS, metrics_ports, strict=True):
            args = ["--model", str(bundled_dir), "--served-model-name", "minilm", "--dtype", "float32",
                    "--device", "cpu", "--max-client-batch-size", "4", "--metrics-port", str(metrics_port),
                    "--max-connection-age", "1"]  # fmt: skip
            _target, proc = stack.enter_context(running_server(args, host=host, port=port))
            procs.append(proc)
        dns = stack.enter_context(FakeDns({NAME: list(HOSTS)}))
        yield f"dns://127.0.0.1:{dns.port}/{NAME}:{port}", metrics_ports, procs, dns


def ok_embeds(metrics_ports: list[int]) -> list[float]:
    return [
        scrape(port, host).total("embedserv_requests_total", rpc="Embed", status="OK")
        for host, port in zip(HOSTS[: len(metrics_ports)], metrics_ports, strict=True)
    ]


def test_round_robin_spreads_calls_over_both_replicas(replicas):
    target, metrics_ports, _procs, dns = replicas
    before = ok_embeds(metrics_ports)
    with Client(target, model="minilm") as client:
        vectors = [client.embed(text) for text in TEXTS[:20]]
        split = client.embed(TEXTS)  # 6 requests of 4, 4 in flight at once
    after = ok_embeds(metrics_ports)
    received = [a - b for a, b in zip(after, before, strict=True)]
    assert dns.queries[(NAME, "A")] >= 1, "the client did not resolve the name through the fake DNS"
    # 20 one-text calls and 6 split requests; round robin alternates the two ready replicas.
    assert sum(received) == 26
    assert min(received) >= 8, f"calls per replica: {received}"
    np.testing.assert_allclose(split[:20], np.stack(vectors), atol=1e-6)


def test_without_round_robin_one_replica_takes_everything(replicas):
    """The contrast: gRPC's default pick_first sticks to one address, which is why the client turns
    round_robin on."""
    target, metrics_ports, _procs, _dns = replicas
    before = ok_embeds(metrics_ports)
    with Client(target, model="minilm", load_balancing=None) as client:
        for text in TEXTS[:10]:
            client.embed(text)
    received = sorted(a - b for a, b in zip(ok_embeds(metrics_ports), before, strict=True))
    assert received == [0, 10]


def test_a_replica_added_behind_the_name_gets_calls_once_connections_age_out(replicas):
    """A new pod joins the headless Service: the name now resolves to one more address. gRPC looks the
    name up again only when a connection closes; --max-connection-age closes them (GOAWAY) every ~1 s
    here, so the client finds the new replica without being restarted."""
    target, metrics_ports, _procs, dns = replicas
    dns.records[NAME] = [HOSTS[0]]
    try:
        fast_lookup = [("grpc.dns_min_time_between_resolutions_ms", 200)]
        with Client(target, model="minilm", options=fast_lookup) as client:
            before = ok_embeds(metrics_ports)
            for text in TEXTS[:5]:
                client.embed(text)
            assert [a - b for a, b in zip(ok_embeds(metrics_ports), before, strict=True)] == [5, 0]
            dns.records[NAME] = list(HOSTS)
            deadline = time.monotonic() + 30
            while ok_embeds(metrics_ports)[1] == before[1] and time.monotonic() < deadline:
                client.embed(TEXTS[0])
                time.sleep(0.05)
        assert ok_embeds(metrics_ports)[1] > before[1], "the added replica never received a call"
    finally:
        dns.records[NAME] = list(HOSTS)


def test_calls_keep_succeeding_when_a_replica_goes_away(replicas):
    """Last in the module: it stops the second replica. gRPC marks the closed connection and round
    robin skips it; a call that lands on it as it closes is UNAVAILABLE and retried."""
    target, metrics_ports, procs, _dns = replicas
    with Client(target, model="minilm", retry=RetryPolicy(max_attempts=10)) as client:
        expected = client.embed(TEXTS[:8])
        stop_process(procs[1])
        assert procs[1].returncode == 0
        before = ok_embeds(metrics_ports[:1])[0]
        for _ in range(5):
            np.testing.assert_allclose(client.embed(TEXTS[:8]), expected, atol=1e-6)
        assert ok_embeds(metrics_ports[:1])[0] - before == 10
    with pytest.raises(OSError):  # its metrics port is closed too
        scrape(metrics_ports[1], HOSTS[1])
    with grpc.insecure_channel(f"{HOSTS[1]}:{target.rsplit(':', 1)[1]}") as channel:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=1)
