"""The engine's watch on frontend connections (engine.process.server.PeerWatch), on a fake clock."""

import engine.process.server as server
from engine.process.server import PeerWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(monkeypatch, timeout: float = 10.0) -> tuple[PeerWatch, Clock]:
    clock = Clock()
    monkeypatch.setattr(server.time, "monotonic", clock)
    return PeerWatch(timeout), clock


def _tick(watch: PeerWatch, clock: Clock, seconds: float) -> list[bytes]:
    """Advance in receive-loop ticks of 0.1 s, collecting who went silent."""
    gone = []
    for _ in range(round(seconds * 10)):
        clock.now += 0.1
        gone += watch.silent()
    return gone


def test_a_pinging_connection_that_goes_silent_is_reported_once(monkeypatch):
    watch, clock = _watch(monkeypatch)
    watch.heard(b"a", is_ping=True)
    assert _tick(watch, clock, 9.5) == []
    watch.heard(b"a", is_ping=False)  # any message counts as a sign of life
    assert _tick(watch, clock, 9.5) == []
    assert _tick(watch, clock, 1.0) == [b"a"]
    assert _tick(watch, clock, 20) == []


def test_a_connection_that_never_pings_is_not_watched(monkeypatch):
    watch, clock = _watch(monkeypatch)
    watch.heard(b"bare-client", is_ping=False)
    assert _tick(watch, clock, 30) == []


def test_the_engines_own_freeze_blames_nobody(monkeypatch):
    watch, clock = _watch(monkeypatch)
    watch.heard(b"a", is_ping=True)
    _tick(watch, clock, 2)
    clock.now += 60  # the engine was stopped: no tick for a minute
    assert watch.silent() == []
    assert _tick(watch, clock, 7.5) == []  # the 8 s it had left, counted from the resume
    assert _tick(watch, clock, 1) == [b"a"]


def test_timeout_zero_watches_nothing(monkeypatch):
    watch, clock = _watch(monkeypatch, timeout=0)
    watch.heard(b"a", is_ping=True)
    assert _tick(watch, clock, 100) == []
