"""What `sluice serve` would start, without starting it: for tests of flag forwarding."""

from sluice import cli


def serve_argvs(monkeypatch, argv: list[str]) -> tuple[list[str], list[str]]:
    """The engine and frontend command lines `sluice serve argv` would start."""
    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    monkeypatch.setattr(cli, "_supervise", lambda *a, **k: 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    cli._serve(cli.parse_args(["serve", *argv]))
    return started[0][3:], started[1][3:]  # after `python -m sluice`
