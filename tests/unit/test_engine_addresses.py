"""Engine addresses (issue 18): the dns+tcp:// form, and the frontend's repeated
--engine-address, --routing and the engine's --engine-id as the CLI turns them into config."""

from __future__ import annotations

import socket

import pytest

from shared.transport import is_dns_address, split_dns_address, tcp_address
from sluice import cli


def test_the_dns_form():
    assert is_dns_address("dns+tcp://sluice-engine:5555")
    assert not is_dns_address("tcp://sluice-engine:5555")
    assert split_dns_address("dns+tcp://sluice-engine:5555") == ("sluice-engine", 5555)
    assert split_dns_address("dns+tcp://[::1]:7") == ("::1", 7)
    for bad in ("dns+tcp://name", "dns+ipc:///tmp/x", "dns+tcp://:5555", "dns+tcp://n:0",
                "tcp://n:1"):
        with pytest.raises(ValueError, match="dns\\+tcp://NAME:PORT"):
            split_dns_address(bad)
    assert tcp_address("10.0.0.1", 5555) == "tcp://10.0.0.1:5555"
    assert tcp_address("fd00::1", 5555) == "tcp://[fd00::1]:5555"


def test_frontend_takes_every_engine_address_and_a_routing_policy():
    args = cli.parse_args(["frontend", "--engine-address", "tcp://a:1", "--engine-address",
                           "dns+tcp://engines:5555", "--routing", "least-loaded"])
    config = cli.frontend_config(args, args.engine_address, None)
    assert config.engine_addresses == ["tcp://a:1", "dns+tcp://engines:5555"]
    assert config.engine_address == "tcp://a:1" and config.routing == "least-loaded"
    assert config.result_address.startswith("tcp://127.0.0.1:")  # engines not on ipc
    defaults = cli.parse_args(["frontend"])
    config = cli.frontend_config(defaults, defaults.engine_address, None)
    assert config.engine_addresses == [cli.DEFAULT_ENGINE_ADDRESS]
    assert config.routing == "prefix"
    with pytest.raises(SystemExit):
        cli.parse_args(["frontend", "--routing", "random"])


def test_engine_id_defaults_to_the_hostname_and_address():
    args = cli.parse_args(["engine", "--engine-address", "tcp://0.0.0.0:5555"])
    config = cli.engine_config(args, args.engine_address)
    assert config.engine_id == f"{socket.gethostname()}@tcp://0.0.0.0:5555"
    args = cli.parse_args(["engine", "--engine-id", "gpu-3"])
    assert cli.engine_config(args, args.engine_address).engine_id == "gpu-3"


def test_postproc_takes_every_engine_and_serve_data_parallel_size():
    args = cli.parse_args(["postproc", "--engine-postproc-address", "tcp://a:1",
                           "--engine-postproc-address", "dns+tcp://engines:5556"])
    assert args.engine_postproc_address == ["tcp://a:1", "dns+tcp://engines:5556"]
    assert cli.parse_args(["serve", "-dp", "3"]).data_parallel_size == 3
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--data-parallel-size", "0"])


def test_serve_data_parallel_starts_n_engines_each_on_its_cpus(monkeypatch):
    started = []

    class Child:
        def __init__(self, argv, **kwargs):
            started.append((argv[3:], kwargs))

    monkeypatch.setattr(cli.subprocess, "Popen", Child)
    monkeypatch.setattr(cli, "_supervise", lambda *a, **k: 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cli._serve(cli.parse_args(["serve", "-dp", "2", "--device", "cpu",
                               "--postproc-workers", "1", "--routing", "round-robin"]))
    engines = [(a, k) for a, k in started if a[0] == "engine"]
    [(frontend, _)] = [(a, k) for a, k in started if a[0] == "frontend"]
    [(worker, _)] = [(a, k) for a, k in started if a[0] == "postproc"]
    assert len(engines) == 2
    addresses = [a[a.index("--engine-address") + 1] for a, _ in engines]
    assert len(set(addresses)) == 2
    assert [a[a.index("--engine-id") + 1] for a, _ in engines] == ["engine-0", "engine-1"]
    # Each engine on half the CPUs, with as many threads; the frontend on both engines.
    assert [a[a.index("--threads") + 1] for a, _ in engines] == ["2", "2"]
    assert all("preexec_fn" in k for _, k in engines)
    assert [frontend[i + 1] for i, x in enumerate(frontend) if x == "--engine-address"] == \
        addresses
    assert frontend[frontend.index("--routing") + 1] == "round-robin"
    # The worker registers with both engines' postproc sockets.
    postproc = [a[a.index("--postproc-address") + 1] for a, _ in engines]
    assert [worker[i + 1] for i, x in enumerate(worker)
            if x == "--engine-postproc-address"] == postproc
