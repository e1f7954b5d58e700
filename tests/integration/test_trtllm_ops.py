"""TensorRT-LLM's operator routes and fields (seed 000, issue 57) over real processes: an
engine with --profile-dir and a fake powercap tree, and one frontend (hermes tool parser,
a 2 s /health_generate bound). Its own engine, because the last test freezes it."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.conftest import SHARED_ENGINE_ARGS
from tests.servers import engine_and_frontend, wait_until

pytestmark = pytest.mark.slow  # starts its own engine (the last test freezes it)

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trtllm")
    profile_dir, powercap = tmp / "profiles", tmp / "powercap"
    _fake_rapl(powercap)
    previous = os.environ.get("SLUICE_POWERCAP_DIR")
    os.environ["SLUICE_POWERCAP_DIR"] = str(powercap)  # the engine's environment
    try:
        engine, frontend = engine_and_frontend(
            str(tmp), (*SHARED_ENGINE_ARGS, "--profile-dir", str(profile_dir)), "frontend",
            "--health-generate-timeout", "2")
    finally:
        if previous is None:
            os.environ.pop("SLUICE_POWERCAP_DIR")
        else:
            os.environ["SLUICE_POWERCAP_DIR"] = previous
    frontend.profile_dir, frontend.powercap = profile_dir, powercap
    with httpx.Client(base_url=frontend.base_url, timeout=60) as client:
        frontend.http = client
        yield engine, frontend
    frontend.stop()
    engine.stop()


def _fake_rapl(root) -> None:
    """A package zone and its core domain, as Linux lays them out, and the control folder."""
    (root / "intel-rapl").mkdir(parents=True)
    for zone, name, uj in (("intel-rapl:0", "package-0", 123456789),
                           ("intel-rapl:0:0", "core", 5000000)):
        (root / zone).mkdir()
        (root / zone / "name").write_text(name + "\n")
        (root / zone / "energy_uj").write_text(f"{uj}\n")


def test_server_info_and_steady_clock(ops):
    _, f = ops
    info = f.http.get("/server_info").json()
    assert info["disaggregated_params"] is None and info["model"] == MODEL
    assert info["engines"] == 1 and info["steady_clock_offset"] == 0.0
    before = time.monotonic()
    clock = f.http.get("/steady_clock_offset").json()
    after = time.monotonic()
    # The steady clock (CLOCK_MONOTONIC, one per machine): between the client's two reads.
    assert before <= clock["receive_ts"] <= clock["transmit_ts"] <= after
    assert f.http.post("/steady_clock_offset", json={"offset": -0.25}).status_code == 200
    assert f.http.get("/server_info").json()["steady_clock_offset"] == -0.25
    for bad in ({"offset": 1e10}, {"offset": "1"}, {}, {"offset": 1, "other": 2}, [1]):
        r = f.http.post("/steady_clock_offset", json=bad)
        assert r.status_code == 400, (bad, r.text)
    r = f.http.post("/steady_clock_offset", content=b'{"offset": NaN}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_energy_metrics_read_the_powercap_counters(ops):
    _, f = ops
    r = f.http.get("/energy_metrics")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "energy_metrics" and len(body["engines"]) == 1
    readings = {x["source"]: x["energy_j"] for x in body["engines"][0]["readings"]}
    assert readings == {"rapl:intel-rapl:0:package-0": 123.456789,
                        "rapl:intel-rapl:0:0:core": 5.0}
    (f.powercap / "intel-rapl:0" / "energy_uj").write_text("123556789\n")  # 0.1 J later
    later = f.http.get("/energy_metrics").json()["engines"][0]["readings"]
    assert {x["source"]: x["energy_j"] for x in later}["rapl:intel-rapl:0:package-0"] == \
        pytest.approx(123.556789)
    for zone in ("intel-rapl:0", "intel-rapl:0:0"):
        (f.powercap / zone / "energy_uj").unlink()
    if not _nvml_gpus():
        r = f.http.get("/energy_metrics")
        assert r.status_code == 404 and "energy" in r.json()["error"]["message"]


def _nvml_gpus() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:  # noqa: BLE001 - no driver: no GPU counters
        return False


def test_profile_routes_write_a_trace_of_the_engine_steps(ops):
    _, f = ops
    r = f.http.post("/stop_profile")
    assert r.status_code == 400 and "not running" in r.json()["error"]["message"]
    assert f.http.post("/start_profile").status_code == 200
    r = f.http.post("/start_profile")
    assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
    assert f.http.post("/v1/chat/completions", json=CHAT).status_code == 200
    r = f.http.post("/stop_profile")
    assert r.status_code == 200, r.text
    [trace] = r.json()["traces"]
    path = trace["path"]
    assert os.path.dirname(path) == str(f.profile_dir) and path.endswith(".pt.trace.json")
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    names = {e.get("name", "") for e in events}
    # The model's own operators ran inside the profile: a step's matmuls were recorded.
    assert any(n in names for n in ("aten::mm", "aten::linear", "aten::addmm")), sorted(names)[:40]
    assert f.http.get("/start_profile").status_code == 405


def test_conversation_and_scheduling_params(ops):
    _, f = ops
    good = [{"conversation_params": {"conversation_id": "chat-1"}},
            {"conversation_params": {"conversation_id": " c ", "subagent_affinity_id": "p"}},
            {"scheduling_params": {"attention_dp_rank": 0, "attention_dp_relax": False,
                                   "priority_tier": 15, "organization_id": "org"}},
            {"scheduling_params": {"attention_dp_rank": 0, "attention_dp_relax": True}},
            {"scheduling_params": {"priority_tier": 0}, "conversation_params": None}]
    for extra in good:
        r = f.http.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 200, (extra, r.text)
    r = f.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                             **good[0], **good[2]})
    assert r.status_code == 200, r.text
    bad = [({"conversation_params": {"conversation_id": ""}}, "conversation_id"),
           ({"conversation_params": {"conversation_id": "   "}}, "conversation_id"),
           ({"conversation_params": {"conversation_id": "x" * 1025}}, "conversation_id"),
           ({"conversation_params": {}}, "conversation_id"),
           ({"conversation_params": {"conversation_id": 7}}, "conversation_id"),
           ({"conversation_params": {"conversation_id": "a", "extra": 1}}, "extra"),
           ({"conversation_params": "chat-1"}, "conversation_params"),
           ({"scheduling_params": {"attention_dp_rank": 1}}, "attention_dp_rank"),
           ({"scheduling_params": {"attention_dp_rank": -1}}, "attention_dp_rank"),
           ({"scheduling_params": {"attention_dp_rank": "0"}}, "attention_dp_rank"),
           ({"scheduling_params": {"attention_dp_relax": True}}, "attention_dp_relax"),
           ({"scheduling_params": {"priority_tier": 16}}, "priority_tier"),
           ({"scheduling_params": {"priority_tier": -1}}, "priority_tier"),
           ({"scheduling_params": {"priority_tier": 1.5}}, "priority_tier"),
           ({"scheduling_params": {"organization_id": ""}}, "organization_id"),
           ({"scheduling_params": {"no_such_key": 1}}, "no_such_key")]
    for extra, field in bad:
        r = f.http.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert field in (error["param"] or "") + error["message"], (extra, error)


def test_health_generate_fails_while_the_engine_is_frozen(ops):
    """Last: it freezes the engine. A real one-token generation: 200 while the engine
    answers, 503 within the bound when it is stopped, 200 again once it runs."""
    engine, f = ops
    r = f.http.get("/health_generate")
    assert r.status_code == 200 and r.text == "Generation health check OK"
    os.kill(engine.proc.popen.pid, signal.SIGSTOP)
    try:
        r = f.http.get("/health_generate")
        assert r.status_code == 503, r.text
        assert "did not generate within 2 s" in r.json()["error"]["message"]
    finally:
        os.kill(engine.proc.popen.pid, signal.SIGCONT)
    wait_until(lambda: f.http.get("/health_generate").status_code == 200, 60,
               "generation to come back")
