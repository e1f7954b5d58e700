"""ZeroMQ helpers: addresses, socket construction, and lazily connected push sockets."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

import zmq


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_ipc_address(prefix: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"sluice-{prefix}-{uuid.uuid4().hex[:12]}.sock")
    return f"ipc://{path}"


def remove_ipc_file(address: str) -> None:
    """Removes an ipc:// address's socket file, if any (ZeroMQ removes it only when the
    socket that bound it is closed, not when its process is killed)."""
    if address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://"):])
        except FileNotFoundError:
            pass


def make_socket(ctx: zmq.Context, kind: int, *, linger_ms: int = 0, hwm: int = 0) -> zmq.Socket:
    sock = ctx.socket(kind)
    # Don't hang process exit on undeliverable messages; peers watch heartbeats instead.
    sock.setsockopt(zmq.LINGER, linger_ms)
    # 0 = unbounded queues: dropping a token batch would lose output silently.
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class PushPool:
    """PUSH sockets to result addresses, connected on first use and reused afterwards.

    Owned by one thread: zmq sockets are not thread-safe.
    """

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, address: str, payload: bytes) -> None:
        sock = self._sockets.get(address)
        if sock is None:
            sock = make_socket(self._ctx, zmq.PUSH)
            sock.connect(address)
            self._sockets[address] = sock
        sock.send(payload, copy=False)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()


# ---------------------------------------------------------------- engine addresses

DNS_PREFIX = "dns+"


def is_dns_address(address: str) -> bool:
    """`dns+tcp://NAME:PORT`: every A/AAAA record of NAME (a Kubernetes headless Service),
    re-resolved while running, so engines may join and leave."""
    return address.startswith(DNS_PREFIX)


def split_dns_address(address: str) -> tuple[str, int]:
    """(NAME, PORT) of a `dns+tcp://NAME:PORT`; ValueError for anything else."""
    rest = address[len(DNS_PREFIX):] if is_dns_address(address) else ""
    if not rest.startswith("tcp://"):
        raise ValueError(f"{address!r}: the DNS form is dns+tcp://NAME:PORT")
    host, sep, port = rest[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: the DNS form is dns+tcp://NAME:PORT")
    return host, int(port)


def resolve_host(host: str, port: int) -> list[str]:
    """Every address NAME resolves to (A and AAAA records), each once, in resolver order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def tcp_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
