"""TensorRT-LLM's operator commands and scheduling fields below HTTP (seed 000, issue 57):
the engine's profiler (its traces: the integration test) and energy reader, priority tiers
in its queue, and the placement of pinned and conversation requests. The routes themselves:
tests/integration/test_trtllm_ops.py."""

from __future__ import annotations

import msgspec
import pytest

from engine.process.energy import rapl_readings
from engine.process.profiler import EngineProfiler, ProfileError
from frontend.engine_client.placement import (
    Candidate,
    PinnedUnavailable,
    Placement,
    conversation_key,
    prefix_key,
)
from shared.protocol import pack_ids
from shared.startup_checks import StartupError
from tests.unit.engine_builders import build_core, drain, random_weights, request

PROMPT = [(7 * i + 3) % 120 for i in range(5)]


def test_profiler_without_a_directory_answers_404():
    profiler = EngineProfiler(None, "engine-0")
    for command in (profiler.start, profiler.stop):
        with pytest.raises(ProfileError) as refused:
            command()
        assert refused.value.status == 404 and "--profile-dir" in str(refused.value)


def test_a_profile_dir_the_engine_cannot_make_stops_it_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StartupError, match="--profile-dir"):
        EngineProfiler(str(blocker / "traces"), "engine-0")


def test_rapl_reads_every_zone_with_a_counter(tmp_path):
    (tmp_path / "intel-rapl").mkdir()  # the control folder: no counter
    for zone, name, value in (("intel-rapl:0", "package-0", "2500000"),
                              ("intel-rapl:0:1", "dram", "1000"),
                              ("intel-rapl:1", "package-1", "not a number"),
                              ("intel-rapl-mmio:0", "package-0", "7000000")):
        (tmp_path / zone).mkdir()
        (tmp_path / zone / "name").write_text(name + "\n")
        (tmp_path / zone / "energy_uj").write_text(value + "\n")
    (tmp_path / "intel-rapl:2").mkdir()  # a zone without a name file
    (tmp_path / "intel-rapl:2" / "energy_uj").write_text("5\n")
    readings = {r.source: r.energy_j for r in rapl_readings(str(tmp_path))}
    assert readings == {"rapl:intel-rapl:0:package-0": 2.5, "rapl:intel-rapl:0:1:dram": 0.001,
                        "rapl:intel-rapl-mmio:0:package-0": 7.0}
    assert rapl_readings(str(tmp_path / "nowhere")) == []


@pytest.mark.usefixtures("one_thread")
def test_a_higher_priority_tier_runs_first_then_priority_within_it():
    core, _ = build_core(random_weights(), max_num_seqs=1, policy="priority")
    order = []
    for request_id, tier, priority in [("t0", 0, -5), ("t2-late", 2, 3), ("t1", 1, -9),
                                       ("t2", 2, -1)]:
        core.add(msgspec.structs.replace(request(request_id, PROMPT, max_tokens=2),
                                         priority_tier=tier, priority=priority))
    while core.has_work:
        order += [out.request_id for _, out in core.step() if out.finish_reason is not None]
    assert order == ["t2", "t2-late", "t1", "t0"]


@pytest.mark.usefixtures("one_thread")
def test_the_engine_refuses_a_tier_out_of_range():
    core, _ = build_core(random_weights())
    for tier in (-1, 16):
        core.add(msgspec.structs.replace(request(f"tier{tier}", PROMPT, max_tokens=2),
                                         priority_tier=tier))
    core.add(msgspec.structs.replace(request("ok", PROMPT, max_tokens=2), priority_tier=15))
    results = drain(core)
    for tier in (-1, 16):
        assert "priority_tier" in results[f"tier{tier}"].error
    assert results["ok"].error is None


def _engines(*loads: int) -> list[Candidate]:
    return [Candidate(name=f"engine-{i}", load=load) for i, load in enumerate(loads)]


def test_a_strict_pin_takes_its_engine_whatever_its_load():
    placement = Placement()
    assert placement.choose_pinned("engine-1", False, _engines(0, 50, 0)) == "engine-1"
    with pytest.raises(PinnedUnavailable, match="attention_dp_relax"):
        placement.choose_pinned(None, False, _engines(0, 0))  # its engine is not live


def test_a_relaxed_pin_yields_to_load_and_to_a_missing_engine():
    placement = Placement(load_factor=1.25)
    assert placement.choose_pinned("engine-1", True, _engines(1, 1, 1)) == "engine-1"
    assert placement.choose_pinned("engine-1", True, _engines(0, 9, 0)) is None
    assert placement.choose_pinned(None, True, _engines(0, 0)) is None


def test_a_conversation_key_stays_as_its_prompt_changes():
    key = conversation_key("chat-1", None)
    assert key == conversation_key("chat-1", None)
    assert key != conversation_key("chat-2", None)
    assert key != conversation_key("chat-1", "tenant-a")  # the salt keeps tenants apart
    # Not any prompt's key: a conversation never lands where a prompt hashing alike would.
    assert key not in {prefix_key(pack_ids(list(range(n))), None) for n in (1, 40)}


class _Conn:
    """What placement reads of an engine connection."""

    def __init__(self, i: int, load: int = 0) -> None:
        self.engine_id, self.address, self.retired, self.stats = f"engine-{i}", f"tcp://e{i}", \
            False, None
        self._load = load

    def load(self) -> int:
        return self._load

    def kv_use(self) -> float:
        return 0.0


def _client(conns):
    from types import SimpleNamespace

    from frontend.engine_client.client import EngineClient

    fake = SimpleNamespace(engines={c.address: c for c in conns}, placement=Placement(),
                           kv_events=None)  # not --routing kv
    fake.ranked_engines = lambda: EngineClient.ranked_engines(fake)
    fake._cached_runs = lambda *args: EngineClient._cached_runs(fake, *args)
    return lambda req, live, hints: EngineClient._place(fake, req, live, hints)


def test_the_engine_client_places_by_the_hints():
    from frontend.engine_client.client import EngineUnavailable
    from frontend.engine_client.placement import RoutingHints

    conns = [_Conn(0), _Conn(1, load=20), _Conn(2)]
    place = _client(conns)
    one = request("r", PROMPT, max_tokens=2)
    # Pinned by rank (--engine-address order), loaded or not; strict to a lost one: refused.
    assert place(one, conns, RoutingHints(engine_rank=1)) is conns[1]
    with pytest.raises(EngineUnavailable):
        place(one, [conns[0], conns[2]], RoutingHints(engine_rank=1))
    relaxed = RoutingHints(engine_rank=1, relax=True)
    assert place(one, [conns[0], conns[2]], relaxed) in (conns[0], conns[2])
    assert place(one, conns, relaxed) is not conns[1]  # past the load bound
    # One conversation, whatever its prompts say, stays on one engine; without the id the
    # prompts' own pages spread them.
    prompts = [[(k * 31 + i) % 120 for i in range(40)] for k in range(12)]
    chat = RoutingHints(affinity="chat-7")
    assert len({id(place(request("c", p), conns, chat)) for p in prompts}) == 1
    assert len({id(place(request("c", p), conns, None)) for p in prompts}) > 1


@pytest.mark.usefixtures("one_thread")
def test_the_engine_answers_every_command_a_peer_may_send(tmp_path, monkeypatch):
    from engine.process.server import EngineServer
    from shared.protocol import EngineCommand

    core, _ = build_core(random_weights())
    server = EngineServer(core, "inproc://unused")
    try:
        bogus = server._step_command(EngineCommand("op", "x" * 10_000))
        assert bogus.op_id == "op" and bogus.status == 400 and len(bogus.message) < 200
        assert server._step_command(EngineCommand("op", "start_profile")).status == 404
        # An idle engine's prefix cache resets; one with an owned page says 409.
        assert server._step_command(EngineCommand("op", "reset_prefix_cache")).status == 200
        page = core.allocator.allocate(1)
        busy = server._step_command(EngineCommand("op", "reset_prefix_cache"))
        assert busy.status == 409 and "1 KV pages are in use" in busy.message
        core.allocator.release(page)
        monkeypatch.setenv("SLUICE_POWERCAP_DIR", str(tmp_path))
        (tmp_path / "intel-rapl:0").mkdir()
        (tmp_path / "intel-rapl:0" / "name").write_text("package-0")
        (tmp_path / "intel-rapl:0" / "energy_uj").write_text("1000000")
        energy = server._read_energy(EngineCommand("e", "read_energy"))
        assert energy.status == 200
        assert ("rapl:intel-rapl:0:package-0", 1.0) in [(r.source, r.energy_j)
                                                         for r in energy.energy]
    finally:
        server.ctx.term()


def test_serve_forwards_the_profile_dir_and_the_probe_bound(monkeypatch, tmp_path):
    from sluice import cli
    from tests.unit.cli_builders import serve_argvs

    engine, frontend = serve_argvs(monkeypatch, ["--profile-dir", str(tmp_path),
                                                 "--health-generate-timeout", "2.5"])
    assert cli.engine_config(cli.parse_args(engine), "ipc:///x").profile_dir == str(tmp_path)
    assert cli.frontend_config(cli.parse_args(frontend), "ipc:///x",
                               None).health_generate_timeout_s == 2.5
    assert cli.engine_config(cli.parse_args(["engine"]), "ipc:///x").profile_dir is None
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/from/vllm")  # vLLM's name, the default
    assert cli.engine_config(cli.parse_args(["engine"]), "ipc:///x").profile_dir == "/from/vllm"
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            cli.parse_args(["frontend", "--health-generate-timeout", bad])
