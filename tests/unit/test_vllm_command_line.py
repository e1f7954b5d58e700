"""vLLM's command line (issue 19): positional MODEL, `--config` YAML, underscore spellings,
`--device auto`."""

from __future__ import annotations

import pytest

from shared import cli


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
        def __init__(self, argv):
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
    monkeypatch.setattr(cli, "_setup_logging", lambda level: None)
    with caplog.at_level("INFO", logger="sluice"):
        assert cli.main(["serve", "--trust-remote-code"]) == 0
    assert [r.getMessage() for r in caplog.records if "changes nothing" in r.getMessage()
            ] == [f"--trust-remote-code changes nothing here: "
                  f"{cli.VLLM_NOOP_FLAGS['--trust-remote-code']}"]


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: sluice has no tensor"),
    (["-tp", "4"], "--tensor-parallel-size 4"),
    (["--quantization", "awq"], "--quantization awq: sluice has no quantization"),
    (["--pipeline_parallel_size", "2"], "--pipeline-parallel-size 2"),
    (["--enable-lora"], "--enable-lora True: sluice has no LoRA"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["--speculative-config", "{}"], "speculative decoding"),
])
def test_flags_for_missing_features_fail_at_start(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_missing_feature_flags_at_their_neutral_value_pass():
    args = cli.parse_args(["serve", "--tensor-parallel-size", "1", "--kv-cache-dtype", "auto",
                           "--cpu-offload-gb", "0"])
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
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv: started.append(argv))
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
            cli.check_generation_config(cli.parse_args([command, *flags]))
        assert message in str(e.value) and str(e.value).startswith("sluice: ")


def test_good_generation_config_passes(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"top_k": 1, "temperature": 0.7}')
    args = cli.parse_args(["serve", "--generation-config", str(tmp_path),
                           "--override-generation-config", '{"top_p": 0.9}'])
    cli.check_generation_config(args)  # no SystemExit
