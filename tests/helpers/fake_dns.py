"""A tiny authoritative DNS server for tests: one name -> several loopback IPs.

Why it exists: a Kubernetes headless Service is one DNS name that resolves to
every pod IP (same port), and gRPC's ``round_robin`` spreads calls over them.
To reproduce that locally we bind servers on 127.0.0.1:P and 127.0.0.2:P (all
of 127.0.0.0/8 is loopback on Linux) and need a name that resolves to both,
without touching /etc/hosts.  gRPC's c-ares resolver accepts a DNS server in
the target's authority -- ``dns://127.0.0.1:DNSPORT/embedserv.test:P`` -- so
this module is that DNS server: stdlib only, UDP and TCP, in a daemon thread.

    with FakeDns({"embedserv.test": ["127.0.0.1", "127.0.0.2"]}) as dns:
        target = f"dns://127.0.0.1:{dns.port}/embedserv.test:{port}"

Answers: A queries for known names get every address; any other type for a
known name gets NOERROR with no answers; unknown names get NXDOMAIN.  EDNS OPT
records in the additional section are ignored.  ``dns.queries`` counts
questions per (name, type name), e.g. ``dns.queries[("embedserv.test", "A")]``,
and ``dns.transports`` counts them per "udp"/"tcp".  ``force_tcp=True`` makes
every UDP reply truncated (TC bit, no answers), so resolvers must retry on TCP.
"""

from __future__ import annotations

import collections
import contextlib
import selectors
import socket
import struct
import threading

TYPE_NAMES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA", 33: "SRV", 41: "OPT"}
QTYPE_A, CLASS_IN = 1, 1
NOERROR, FORMERR, NXDOMAIN, NOTIMP = 0, 1, 3, 4


def parse_question(msg: bytes) -> tuple[int, int, str, int, int, bytes]:
    """Return (id, flags, name, qtype, qclass, raw question bytes) of a query's first question."""
    qid, flags, qdcount = struct.unpack_from("!HHH", msg)
    if qdcount < 1:
        raise ValueError("no question")
    pos, labels = 12, []
    while (length := msg[pos]) != 0:
        if length & 0xC0:  # compression pointers never occur in a query's first name
            raise ValueError("compressed name in question")
        labels.append(msg[pos + 1 : pos + 1 + length].decode("ascii"))
        pos += 1 + length
    qtype, qclass = struct.unpack_from("!HH", msg, pos + 1)
    # Anything after the question (e.g. an EDNS OPT record in the additional section) is ignored.
    return qid, flags, ".".join(labels), qtype, qclass, msg[12 : pos + 5]


class FakeDns:
    def __init__(self, records: dict[str, list[str]], ttl: int = 1, host: str = "127.0.0.1", force_tcp: bool = False):
        self.records = {name.lower().rstrip("."): list(addrs) for name, addrs in records.items()}
        self.ttl, self.host, self.force_tcp = ttl, host, force_tcp
        self.queries: collections.Counter = collections.Counter()
        self.transports: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []

    def answer(self, query: bytes, truncate: bool = False) -> bytes:
        """Build the response message for one query message (``truncate``: TC bit set, no answers)."""
        try:
            qid, flags, name, qtype, qclass, question = parse_question(query)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError):
            return struct.pack("!HHHHHH", int.from_bytes(query[:2], "big"), 0x8000 | FORMERR, 0, 0, 0, 0)
        key = name.lower().rstrip(".")
        with self._lock:
            self.queries[(key, TYPE_NAMES.get(qtype, str(qtype)))] += 1
        opcode, answers = (flags >> 11) & 0xF, []
        if opcode != 0:
            rcode = NOTIMP
        elif key not in self.records:
            rcode = NXDOMAIN
        else:
            rcode = NOERROR
            if qtype == QTYPE_A and qclass == CLASS_IN and not truncate:
                rr = struct.pack("!HHHIH", 0xC00C, QTYPE_A, CLASS_IN, self.ttl, 4)  # 0xC00C: the question's name
                answers = [rr + socket.inet_aton(addr) for addr in self.records[key]]
        # QR=1, opcode echoed, AA=1, TC if truncated, RD copied, RA=1.
        out_flags = 0x8000 | (opcode << 11) | 0x0400 | (truncate << 9) | (flags & 0x0100) | 0x0080 | rcode
        header = struct.pack("!HHHHHH", qid, out_flags, 1, len(answers), 0, 0)
        return header + question + b"".join(answers)

    def __enter__(self) -> FakeDns:
        for _ in range(20):  # UDP and TCP on the same port: retry if the TCP port is taken
            self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._udp.bind((self.host, 0))
            self.port = self._udp.getsockname()[1]
            self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._tcp.bind((self.host, self.port))
                break
            except OSError:
                self._udp.close()
                self._tcp.close()
        else:
            raise RuntimeError("no free port for both UDP and TCP")
        self._tcp.listen(16)
        self._thread = threading.Thread(target=self._serve, name="fake-dns", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self._conns:  # wakes the TCP threads' blocked reads
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._udp.close()
        self._tcp.close()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._udp, selectors.EVENT_READ)
            sel.register(self._tcp, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.05):
                    try:
                        if key.fileobj is self._udp:
                            data, peer = self._udp.recvfrom(65535)
                            self._count("udp")
                            self._udp.sendto(self.answer(data, truncate=self.force_tcp), peer)
                        else:
                            conn, _ = self._tcp.accept()  # one thread per connection: c-ares may keep it open
                            self._conns.append(conn)
                            threading.Thread(target=self._serve_tcp, args=(conn,), daemon=True).start()
                    except OSError:
                        pass

    def _serve_tcp(self, conn: socket.socket) -> None:
        """Answer 2-byte-length-prefixed queries on one connection until the client closes it."""
        with conn, conn.makefile("rb") as stream:
            try:
                while len(prefix := stream.read(2)) == 2:
                    size = struct.unpack("!H", prefix)[0]
                    if len(query := stream.read(size)) < size:
                        return
                    self._count("tcp")
                    reply = self.answer(query)
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
            except (OSError, ValueError):  # ValueError: stream closed by __exit__
                pass

    def _count(self, transport: str) -> None:
        with self._lock:
            self.transports[transport] += 1
