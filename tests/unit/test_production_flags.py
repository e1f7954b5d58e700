"""The limit flags reach FrontendConfig, `serve` forwards them, and the CLI sets the metrics
directory before prometheus_client can be imported (req L-3)."""

from __future__ import annotations

import subprocess
import sys

from sluice import cli


def _limits(argv: list[str], monkeypatch, env_keys: str | None = None) -> dict:
    if env_keys is None:
        monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SLUICE_API_KEY", env_keys)
    return cli.limit_config(cli.build_parser().parse_args(["frontend", *argv]))


def test_defaults(monkeypatch):
    limits = _limits([], monkeypatch)
    assert limits["api_keys"] == [] and limits["allowed_origins"] == []
    assert limits["allowed_methods"] == ["*"] and limits["allowed_headers"] == ["*"]
    assert limits["max_request_body_bytes"] == 32 * 2**20
    assert limits["max_queued_requests"] is None and limits["request_timeout_s"] is None
    assert limits["shutdown_timeout_s"] == 30.0


def test_keys_from_flags_and_environment(monkeypatch):
    limits = _limits(["--api-key", "a", "--api-key", "b"], monkeypatch, env_keys="b, c,")
    assert limits["api_keys"] == ["a", "b", "c"]


def test_origins_as_words_or_a_json_list(monkeypatch):
    limits = _limits(["--allowed-origins", "https://a.example", "https://b.example",
                      "--allowed-origins", '["https://c.example"]'], monkeypatch)
    assert limits["allowed_origins"] == ["https://a.example", "https://b.example",
                                         "https://c.example"]


def test_serve_forwards_every_limit(monkeypatch):
    argv = ["--allowed-origins", "*", "--allowed-methods", "GET", "POST",
            "--allow-credentials", "--max-request-body-bytes", "100",
            "--max-queued-requests", "7", "--request-timeout", "9.5",
            "--shutdown-timeout", "3"]
    serve = cli.build_parser().parse_args(["serve", *argv])
    forwarded = _limits(cli.limit_argv(serve), monkeypatch)
    assert forwarded == _limits(argv, monkeypatch)


def test_cli_imports_no_prometheus_before_the_directory_is_set():
    code = ("import sys, sluice.cli as c; c.build_parser(); "
            "assert 'prometheus_client' not in sys.modules, 'imported too early'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_max_stored_responses_reaches_the_frontend_config(monkeypatch):
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    parser = cli.build_parser()
    args = parser.parse_args(["frontend", "--max-stored-responses", "7"])
    assert cli.frontend_config(args, "tcp://127.0.0.1:1", None).max_stored_responses == 7


def test_bounds_and_scheduling_flags_refuse_values_that_make_no_sense(capsys):
    import pytest

    bad = [
        ["frontend", "--max-json-depth", "0"], ["frontend", "--max-n", "-1"],
        ["frontend", "--max-tools", "many"], ["frontend", "--max-stop-strings", "0"],
        ["engine", "--long-prefill-token-threshold", "-5"],
        ["engine", "--frontend-timeout", "-1"], ["engine", "--frontend-timeout", "inf"],
        ["engine", "--frontend-timeout", "nan"],
    ]
    for argv in bad:
        with pytest.raises(SystemExit) as exited:
            cli.build_parser().parse_args(argv)
        assert exited.value.code == 2, argv
        assert argv[1] in capsys.readouterr().err
    args = cli.build_parser().parse_args(
        ["engine", "--long-prefill-token-threshold", "0", "--frontend-timeout", "0"])
    assert (args.long_prefill_token_threshold, args.frontend_timeout) == (0, 0.0)
    assert cli.build_parser().parse_args(["frontend", "--max-n", "1"]).max_n == 1


def test_batch_flags_reach_the_config_and_serve_forwards_them(monkeypatch, capsys):
    import pytest

    from frontend.http.flags import batch_argv, batch_config

    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    argv = ["--max-batch-file-bytes", "1000", "--max-batch-lines", "5",
            "--max-active-batches", "3", "--max-running-batches", "1",
            "--max-batch-lines-in-flight", "2", "--batch-ttl", "60"]
    args = cli.build_parser().parse_args(["frontend", *argv])
    config = cli.frontend_config(args, "tcp://127.0.0.1:1", None)
    assert (config.max_batch_file_bytes, config.max_batch_lines, config.max_active_batches,
            config.max_running_batches, config.max_batch_lines_in_flight,
            config.batch_ttl_s) == (1000, 5, 3, 1, 2, 60.0)
    serve = cli.build_parser().parse_args(["serve", *argv])
    forwarded = cli.build_parser().parse_args(["frontend", *batch_argv(serve)])
    assert batch_config(forwarded) == batch_config(args)
    for flag, value in (("--max-batch-lines", "0"), ("--max-batch-lines-in-flight", "-1"),
                        ("--max-batch-file-bytes", "big"), ("--batch-ttl", "-5")):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["frontend", flag, value])
        assert flag in capsys.readouterr().err
