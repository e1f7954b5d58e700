"""vLLM's command line (issue 19): positional MODEL, `--config` YAML, underscore spellings,
`--device auto`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from shared import startup_checks
from sluice import cli
from tests.unit.cli_builders import serve_argvs as _serve_argvs


def test_positional_model_on_serve_and_engine():
    for command in ("serve", "engine"):
        args = cli.parse_args([command, "/models/a.gguf", "--max-num-seqs", "4"])
        assert args.model == "/models/a.gguf" and args.max_num_seqs == 4


def test_positional_and_flag_must_agree(capsys):
    assert cli.parse_args(["serve", "m", "--model", "m"]).model == "m"
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "a", "--model", "b"])
    assert "given twice" in capsys.readouterr().err


def test_underscores_and_dashes_are_the_same():
    args = cli.parse_args(["serve", "--max_model_len", "2048", "--max_num_seqs=3",
                           "--enforce_eager", "--chat-template", "a_b"])
    assert args.max_model_len == 2048 and args.max_num_seqs == 3 and args.enforce_eager
    assert args.chat_template == "a_b"  # values keep their underscores


def test_config_yaml_supplies_flags_and_the_line_wins(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: /m.gguf\nmax_model_len: 1024\nmax-num-seqs: 8\n"
                      "enforce_eager: true\ntrust_request_chat_template: false\n"
                      "allowed_origins: [https://a.example, https://b.example]\n")
    args = cli.parse_args(["serve", "--config", str(config), "--max-num-seqs", "2"])
    assert args.model == "/m.gguf" and args.max_model_len == 1024
    assert args.max_num_seqs == 2 and args.enforce_eager
    assert not args.trust_request_chat_template
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    config.write_text("allowed_origins: [https://a.example, https://b.example]\n")
    args = cli.parse_args(["frontend", f"--config={config}", "--port", "9"])
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert args.port == 9
    config.write_text("model: /m.gguf\nmax_num_seqs: 8\n")
    with pytest.raises(SystemExit):  # the file's --model and the positional disagree
        cli.parse_args(["engine", f"--config={config}", "/other.gguf"])


@pytest.mark.parametrize("text, message", [
    ("- a\n- b\n", "must map flag names"),
    ("a: [\n", "not YAML"),
    ("config: x.yaml\n", "cannot name another"),
])
def test_bad_config_files_fail_naming_the_file(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit, match=message):
        cli.parse_args(["serve", "--config", str(config)])


def test_missing_config_file_and_unknown_keys_fail(tmp_path, capsys):
    with pytest.raises(SystemExit, match="No such file"):
        cli.parse_args(["serve", "--config", str(tmp_path / "none.yaml")])
    with pytest.raises(SystemExit, match="needs a YAML file"):
        cli.parse_args(["serve", "--config"])
    config = tmp_path / "c.yaml"
    config.write_text("no_such_flag: 1\n")
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--config", str(config)])
    assert "--no-such-flag" in capsys.readouterr().err


def test_empty_config_file_changes_nothing(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("")
    assert cli.parse_args(["serve", "--config", str(config)]).max_num_seqs == 128


def test_device_defaults_to_auto(monkeypatch):
    args = cli.parse_args(["engine"])
    assert args.device == "auto"
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.resolve_device("auto") == "cuda"
    assert cli.resolve_device("cpu") == "cpu" and cli.resolve_device("cuda:1") == "cuda:1"


def test_serve_forwards_the_positional_model_and_auto_device(monkeypatch):
    started = []

    class Child:
        def __init__(self, argv, **kwargs):
            started.append(argv)

    monkeypatch.setattr(cli.subprocess, "Popen", Child)
    monkeypatch.setattr(cli, "_supervise", lambda *a, **k: 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    cli._serve(cli.parse_args(["serve", "/m.gguf"]))
    engine_argv = started[0]
    assert engine_argv[engine_argv.index("--model") + 1] == "/m.gguf"
    assert engine_argv[engine_argv.index("--device") + 1] == "auto"


@pytest.mark.parametrize("command", ["serve", "engine", "frontend", "postproc"])
def test_noop_vllm_flags_are_accepted_with_a_note(command):
    args = cli.parse_args([command, "--trust-remote-code", "--enable_auto_tool_choice",
                           "--disable-log-stats"])
    assert len(args.compat_notes) == 3
    assert args.compat_notes[0].startswith("--trust-remote-code changes nothing here")
    assert cli.parse_args([command]).compat_notes == []


def test_noop_flags_are_logged_once_at_start(monkeypatch, caplog):
    monkeypatch.setattr(cli, "_serve", lambda args: 0)
    monkeypatch.setattr(cli, "_setup_logging", lambda *args: None)
    with caplog.at_level("INFO", logger="sluice"):
        assert cli.main(["serve", "--trust-remote-code"]) == 0
    assert [r.getMessage() for r in caplog.records if "changes nothing" in r.getMessage()
            ] == [f"--trust-remote-code changes nothing here: "
                  f"{cli.VLLM_NOOP_FLAGS['--trust-remote-code']}"]


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "fp8"], "'fp8': sluice runs gptq, gptq_marlin, awq"),
    (["--pipeline_parallel_size", "2"], "--pipeline-parallel-size 2"),
    (["--cpu-offload-gb", "4"], "--cpu-offload-gb 4.0: sluice has no offloading"),
    (["--kv-cache-dtype", "fp4"], "'fp4': choose one of auto, bfloat16, float16, fp8"),
])
def test_flags_for_missing_features_fail_at_start(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_missing_feature_flags_at_their_neutral_value_pass():
    args = cli.parse_args(["serve", "--tensor-parallel-size", "1", "--cpu-offload-gb", "0"])
    assert args.compat_notes == []
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--tensor-parallel-size", "two"])


def test_vllm_names_for_our_flags():
    args = cli.parse_args(["engine", "--block-size", "32", "--num_gpu_blocks_override", "99"])
    assert args.page_size == 32 and args.num_kv_pages == 99


def test_seed_reaches_the_engine_and_serve_forwards_it(monkeypatch):
    args = cli.parse_args(["engine", "--seed", "7"])
    assert cli.engine_config(args, "ipc:///tmp/x").seed == 7
    assert cli.engine_config(cli.parse_args(["engine"]), "ipc:///tmp/x").seed is None
    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    monkeypatch.setattr(cli, "_supervise", lambda *a, **k: 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    cli._serve(cli.parse_args(["serve", "--seed", "0"]))
    assert started[0][started[0].index("--seed") + 1] == "0"


@pytest.mark.parametrize("value", ["-1", "x", str(2**63)])
def test_bad_seeds_fail_at_start(value, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["engine", "--seed", value])
    assert "--seed" in capsys.readouterr().err


def test_prefix_caching_flags():
    assert cli.parse_args(["serve", "--enable-prefix-caching"]).compat_notes == [
        "--enable-prefix-caching changes nothing here: prefix caching is always on"]
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--no-enable-prefix-caching"])


def test_generation_config_flags_parse_and_serve_forwards_them():
    for command in ("serve", "frontend"):
        args = cli.parse_args([command])
        assert args.generation_config == "auto" and args.override_generation_config is None
    args = cli.parse_args(["frontend", "--generation-config", "vllm",
                           "--override_generation_config", '{"top_k": 1}'])
    assert args.generation_config == "vllm"
    config = cli.frontend_config(args, "ipc:///tmp/x", None)
    assert config.generation_config == "vllm"
    assert config.override_generation_config == '{"top_k": 1}'


@pytest.mark.parametrize("flags, message", [
    (["--generation-config", "/no/such/folder"], "not a folder"),
    (["--override-generation-config", "{not json"], "not JSON"),
    (["--override-generation-config", '{"top_kk": 1}'], "unknown fields"),
    (["--override-generation-config", '{"temperature": -1}'], "out of range"),
])
def test_bad_generation_config_fails_at_start(flags, message):
    for command in ("serve", "frontend"):
        with pytest.raises(SystemExit) as e:
            startup_checks.check_generation_config(cli.parse_args([command, *flags]))
        assert message in str(e.value) and str(e.value).startswith("sluice: ")


def test_good_generation_config_passes(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"top_k": 1, "temperature": 0.7}')
    args = cli.parse_args(["serve", "--generation-config", str(tmp_path),
                           "--override-generation-config", '{"top_p": 0.9}'])
    startup_checks.check_generation_config(args)  # no SystemExit


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _model_file(tmp_path) -> str:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # resolution looks at the name only
    return str(tmp_path / "m.gguf")


def test_several_served_model_names(monkeypatch, tmp_path):
    model = _model_file(tmp_path)
    args = cli.parse_args(["frontend", "--model", model, "--served-model-name", "a", "b",
                           "--served_model_name", "c", "a"])
    config = cli.frontend_config(args, "ipc:///tmp/x", None)
    assert config.served_model_name == "a" and config.served_model_aliases == ["b", "c"]
    assert cli.engine_config(cli.parse_args(["engine", "--model", model,
                                             "--served-model-name", "x", "y"]),
                             "ipc:///tmp/x").served_model_name == "x"
    engine, frontend = _serve_argvs(monkeypatch, ["--served-model-name", "a", "b"])
    for argv in (engine, frontend):
        i = argv.index("--served-model-name")
        assert argv[i + 1:i + 3] == ["a", "b"]


def test_tokenizer_resolves_like_the_model(tmp_path, monkeypatch):
    model = _model_file(tmp_path)
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    args = cli.parse_args(["frontend", "--model", model, "--tokenizer", str(folder)])
    assert cli.frontend_config(args, "ipc:///tmp/x", None).tokenizer == str(folder)
    args = cli.parse_args(["engine", "--model", model, "--tokenizer", str(folder)])
    assert cli.engine_config(args, "ipc:///tmp/x").tokenizer == str(folder)
    args = cli.parse_args(["frontend", "--model", model])
    assert cli.frontend_config(args, "ipc:///tmp/x", None).tokenizer == model
    with pytest.raises(ValueError, match="not found"):
        cli.frontend_config(cli.parse_args(["frontend", "--tokenizer", str(tmp_path / "no")]),
                            "ipc:///tmp/x", None)
    engine, frontend = _serve_argvs(monkeypatch, ["--tokenizer", str(folder)])
    assert _after(engine, "--tokenizer") == _after(frontend, "--tokenizer") == str(folder)


def test_kv_cache_memory_bytes_and_queued_requests_aliases(monkeypatch):
    args = cli.parse_args(["engine", "--kv-cache-memory-bytes", str(3 * 2**29)])
    assert cli.engine_config(args, "ipc:///tmp/x").kv_cache_memory_gb == 1.5
    assert cli.engine_config(cli.parse_args(["engine", "--kv-cache-memory-gb", "2"]),
                             "ipc:///tmp/x").kv_cache_memory_gb == 2
    with pytest.raises(SystemExit):
        cli.parse_args(["engine", "--kv-cache-memory-bytes", "0"])
    engine, _ = _serve_argvs(monkeypatch, ["--kv_cache_memory_bytes", str(2**30)])
    assert float(_after(engine, "--kv-cache-memory-gb")) == 1.0
    assert cli.parse_args(["frontend", "--max-num-queued-reqs", "7"]).max_queued_requests == 7


@pytest.mark.parametrize("name, ours", [("TORCH_SDPA", "torch"), ("FLASHINFER", "flashinfer"),
                                        ("flashinfer", "flashinfer"), ("Torch", "torch"),
                                        ("auto", "auto")])
def test_attention_backend_names_in_vllms_case(name, ours):
    assert cli.parse_args(["engine", "--attention-backend", name]).attention_backend == ours


def test_other_attention_backends_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["engine", "--attention-backend", "FLASH_ATTN"])
    assert "not a backend here" in capsys.readouterr().err


def test_max_logprobs(monkeypatch, capsys):
    assert cli.parse_args(["engine"]).max_logprobs == 20
    args = cli.parse_args(["engine", "--max-logprobs", "-1"])
    assert cli.engine_config(args, "ipc:///tmp/x").max_logprobs == -1
    args = cli.parse_args(["frontend", "--max_logprobs", "5"])
    assert cli.frontend_config(args, "ipc:///tmp/x", None).max_logprobs == 5
    for bad in ("-2", "x"):
        with pytest.raises(SystemExit):
            cli.parse_args(["engine", "--max-logprobs", bad])
        assert "--max-logprobs" in capsys.readouterr().err
    engine, frontend = _serve_argvs(monkeypatch, ["--max-logprobs", "3"])
    assert _after(engine, "--max-logprobs") == _after(frontend, "--max-logprobs") == "3"


def test_http_flags_reach_the_frontend_and_serve_forwards_them(tmp_path, monkeypatch):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    argv = ["--root-path", "/llm", "--uds", str(tmp_path / "s.sock"), "--ssl-keyfile", str(key),
            "--ssl-certfile", str(cert), "--ssl-cert-reqs", "1", "--uvicorn-log-level", "warning",
            "--response-role", "bot", "--enable-log-requests", "--enable-log-outputs",
            "--default-chat-template-kwargs", '{"enable_thinking": false}',
            "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
            "--enable-force-include-usage"]
    config = cli.frontend_config(cli.parse_args(["frontend", *argv]), "ipc:///tmp/x", None)
    http = config.http
    assert (http.root_path, http.uds, http.ssl_keyfile, http.ssl_certfile) == (
        "/llm", str(tmp_path / "s.sock"), str(key), str(cert))
    assert http.ssl_cert_reqs == 1 and http.log_level == "warning"
    assert config.response_role == "bot" and config.log_requests and config.log_outputs
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.return_tokens_as_token_ids
    assert config.prompt_tokens_details and config.force_include_usage
    plain = cli.frontend_config(cli.parse_args(["frontend"]), "ipc:///tmp/x", None)
    assert not plain.prompt_tokens_details and not plain.force_include_usage
    assert cli.frontend_config(cli.parse_args(["frontend", "--log-level", "debug"]),
                               "ipc:///tmp/x", None).http.log_level == "debug"
    _, frontend = _serve_argvs(monkeypatch, argv)
    reparsed = cli.frontend_config(cli.parse_args(frontend), "ipc:///tmp/x", None)
    assert reparsed.http == http
    assert reparsed.default_chat_template_kwargs == config.default_chat_template_kwargs
    assert (reparsed.response_role, reparsed.log_requests, reparsed.log_outputs,
            reparsed.return_tokens_as_token_ids) == ("bot", True, True, True)
    assert reparsed.prompt_tokens_details and reparsed.force_include_usage


@pytest.mark.parametrize("flags, message", [
    (["--default-chat-template-kwargs", "{x"], "not JSON"),
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--default-chat-template-kwargs", '{"tools": []}'], "may not set tools"),
    (["--ssl-keyfile", "/no/key.pem"], "needs both"),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/c.pem"], "no such file"),
    (["--root-path", "llm"], "must start with /"),
    (["--root-path", "/llm/"], "must start with /"),
    (["--response-role", ""], "may not be empty"),
    (["--response-role", "  "], "may not be empty"),
    (["--limit-mm-per-prompt", "{image"], "expected JSON"),
    (["--limit-mm-per-prompt", "[1]"], "only an 'image' limit"),
    (["--limit-mm-per-prompt", '{"video": 1}'], "only an 'image' limit"),
    (["--limit-mm-per-prompt", '{"image": -1}'], "integer in [0, 64]"),
    (["--limit-mm-per-prompt", '{"image": 65}'], "integer in [0, 64]"),
    (["--limit-mm-per-prompt", '{"image": true}'], "integer in [0, 64]"),
    (["--limit-mm-per-prompt", '{"image": "2"}'], "integer in [0, 64]"),
    (["--allowed-local-media-path", "/no/such/folder"], "no such folder"),
])
def test_bad_frontend_flags_fail_at_start(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_serve", lambda args: 0)
    monkeypatch.setattr(cli, "_setup_logging", lambda *args: None)
    for command in ("serve", "frontend"):
        with pytest.raises(SystemExit) as failure:
            cli.main([command, *flags])
        assert message in str(failure.value) + capsys.readouterr().err


def test_serve_starts_its_processes_through_the_console_scripts_module(monkeypatch):
    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    monkeypatch.setattr(cli, "_supervise", lambda *a, **k: 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    cli._serve(cli.parse_args(["serve", "--postproc-workers", "1"]))
    assert {tuple(argv[:3]) for argv in started} == {(sys.executable, "-m", "sluice")}
    # ... a module that runs `main` when run, and not a library module doing nothing.
    runner = importlib.util.find_spec("sluice.__main__")
    assert runner is not None and "main()" in Path(runner.origin).read_text()
