"""LoRA in the engine (engine.step.lora_adapters, engine.layers.lora_ops): random PEFT adapters
built with the `peft` library on the tiny Llama give peft's merged model's greedy tokens,
batched with the base model and with each other; --max-loras keeps other adapters waiting; the
prefix cache never hands one adapter's pages to another; bad adapters are refused with their
problem."""

import copy
import json

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from engine.step.lora_adapters import LoraError, LoraManager
from shared.protocol import LoraAdapterInfo, LoraUpdate, unpack_ids
from tests.unit.engine_builders import (
    CONFIG,
    build_core,
    hf_config_kwargs,
    random_weights,
    request,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

STEPS = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def weights():
    return random_weights()


def _hf_base(weights):
    config = transformers.LlamaConfig(**hf_config_kwargs(
        head_dim=CONFIG.head_dim, rms_norm_eps=CONFIG.rms_norm_eps, rope_theta=CONFIG.rope_theta,
        max_position_embeddings=CONFIG.max_position_embeddings, tie_word_embeddings=False))
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict(weights, strict=True)
    return model


def _make_adapter(base, path: str, seed: int, **config):
    """A random PEFT adapter saved at `path`; returns peft's merged model of it."""
    torch.manual_seed(seed)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        init_lora_weights=False, lora_dropout=0.0, **config))
    lora.save_pretrained(path)
    return lora.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(weights, tmp_path_factory):
    """name -> (path, merged model); "base" -> (None, the base model)."""
    root = tmp_path_factory.mktemp("lora")
    base = _hf_base(weights)
    a = _make_adapter(base, str(root / "a"), 1, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    # rsLoRA (alpha / sqrt(r)), a larger rank, only some modules.
    b = _make_adapter(base, str(root / "b"), 2, r=8, lora_alpha=16, use_rslora=True,
                      target_modules=["q_proj", "v_proj", "down_proj"])
    return {"base": (None, base), "a": (str(root / "a"), a), "b": (str(root / "b"), b)}


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _lora_core(weights, adapters, max_loras=4, max_rank=16, **kwargs):
    core, rec = build_core(weights, **kwargs)
    manager = LoraManager(core.runner.model, max_loras, max_rank, 0)
    core.lora, core.runner.lora_ops, core.scheduler.max_loras = manager, manager.ops, max_loras
    for name in ("a", "b"):
        manager.load(LoraAdapterInfo(name, adapters[name][0]))
    steps: list[set[int]] = []  # the adapters of each step
    set_step = manager.ops.set_step

    def recording(row_adapters, num_rows, device):
        steps.append({a for a, _ in row_adapters if a})
        set_step(row_adapters, num_rows, device)

    manager.ops.set_step = recording
    return core, steps


def _lora_request(request_id, prompt, lora, **params):
    req = request(request_id, prompt, max_tokens=STEPS, **params)
    return msgspec.structs.replace(req, lora_name=None if lora == "base" else lora)


def _run(core, requests, cached=None):
    """Step to the end; request id -> tokens, and -> its last output. `cached` gets each
    request's num_cached_tokens (on its first output)."""
    tokens, last = {}, {}
    for r in requests:
        core.add(r)
    while core.has_work:
        for _, out in core.step():
            tokens.setdefault(out.request_id, []).extend(unpack_ids(out.new_token_ids).tolist())
            last[out.request_id] = out
            if cached is not None and out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
    return tokens, last


PROMPTS = [[5, 9, 17, 33, 2, 71, 8], [100, 3, 44], [7] * 11, [60, 61, 62, 63, 64]]


def test_mixed_batch_matches_peft_merged_models(weights, adapters):
    core, steps = _lora_core(weights, adapters)
    cases = [(f"{name}-{i}", name, p) for i, p in enumerate(PROMPTS) for name in adapters]
    tokens, last = _run(core, [_lora_request(rid, p, name) for rid, name, p in cases])
    for rid, name, prompt in cases:
        assert tokens[rid] == _greedy(adapters[name][1], prompt), (rid, last[rid].error)
    # Every adapter changed something, and the steps mixed the base model with both.
    for i in range(len(PROMPTS)):
        assert tokens[f"a-{i}"] != tokens[f"base-{i}"] or tokens[f"b-{i}"] != tokens[f"base-{i}"]
    assert any(len(s) == 2 for s in steps)
    assert not core.sequences and core.allocator.num_free == core.allocator.num_pages


def test_max_loras_keeps_other_adapters_waiting(weights, adapters):
    core, steps = _lora_core(weights, adapters, max_loras=1)
    cases = [("a-0", "a", PROMPTS[0]), ("b-0", "b", PROMPTS[1]), ("base-0", "base", PROMPTS[2]),
             ("a-1", "a", PROMPTS[3])]
    tokens, _ = _run(core, [_lora_request(rid, p, name) for rid, name, p in cases])
    assert all(len(s) <= 1 for s in steps)
    assert {frozenset(s) for s in steps} >= {frozenset({1}), frozenset({2})}
    for rid, name, prompt in cases:
        assert tokens[rid] == _greedy(adapters[name][1], prompt)


def test_prefix_cache_keeps_adapters_apart(weights, adapters):
    core, _ = _lora_core(weights, adapters, page_size=4)
    prompt = list(range(20, 37))  # four full pages
    order = [("base", "p0"), ("a", "p1"), ("a", "p2"), ("b", "p3"), ("base", "p4")]
    cached = {}
    for name, rid in order:  # one at a time: each finds what the earlier ones left
        tokens, _ = _run(core, [_lora_request(rid, prompt, name)], cached)
        assert tokens[rid] == _greedy(adapters[name][1], prompt)
    # p2 reuses p1's pages and p4 p0's; no adapter reads another's (or the base's) pages.
    assert cached == {"p0": 0, "p1": 0, "p2": 16, "p3": 0, "p4": 16}


def test_unknown_adapter_is_a_404_and_the_engine_goes_on(weights, adapters):
    core, _ = _lora_core(weights, adapters)
    tokens, last = _run(core, [_lora_request("x", PROMPTS[0], "nope"),
                               _lora_request("y", PROMPTS[0], "a")])
    assert last["x"].finish_reason == "error" and last["x"].error_status == 404
    assert "nope" in last["x"].error
    assert tokens["y"] == _greedy(adapters["a"][1], PROMPTS[0])


def test_unload_in_use_finishes_its_requests_then_reload(weights, adapters):
    core, _ = _lora_core(weights, adapters)
    manager = core.lora
    core.add(_lora_request("r", PROMPTS[0], "a"))
    core.step()  # admitted and running
    answer = core.update_lora(LoraUpdate("op1", "unload", "a"))
    assert answer.status == 200
    assert "a" not in [i.name for i in core.stats().lora_adapters]
    tokens, last = _run(core, [_lora_request("late", PROMPTS[1], "a")])
    assert last["late"].error_status == 404
    assert len(tokens["r"]) == STEPS - 1 and last["r"].finish_reason == "length"
    assert not manager.ops._products[next(iter(manager.ops._products))].get(1)
    again = core.update_lora(LoraUpdate("op2", "load", "a", adapters["a"][0]))
    assert again.status == 200
    tokens, _ = _run(core, [_lora_request("back", PROMPTS[1], "a")])
    assert tokens["back"] == _greedy(adapters["a"][1], PROMPTS[1])


def test_update_errors(weights, adapters):
    core, _ = _lora_core(weights, adapters)
    twice = core.update_lora(LoraUpdate("1", "load", "a", adapters["a"][0]))
    assert twice.status == 400 and "already been loaded" in twice.message
    unknown = core.update_lora(LoraUpdate("2", "unload", "zzz"))
    assert unknown.status == 404 and "zzz" in unknown.message
    missing = core.update_lora(LoraUpdate("3", "load", "m", "/no/such/adapter"))
    assert missing.status == 404 and "/no/such/adapter" in missing.message


def _bad_adapter(tmp_path, config: dict | str | None, tensors: dict | None):
    path = tmp_path / "bad"
    path.mkdir(exist_ok=True)
    if config is not None:
        (path / "adapter_config.json").write_text(
            config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def _pair(layer, module, rank, out, width):
    prefix = f"base_model.model.model.layers.{layer}.{module}"
    return {f"{prefix}.lora_A.weight": torch.zeros(rank, width),
            f"{prefix}.lora_B.weight": torch.zeros(out, rank)}


GOOD = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
H = CONFIG.hidden_size


@pytest.mark.parametrize("config,tensors,problem", [
    (None, None, "has no adapter_config.json"),
    ("{not json", _pair(0, "self_attn.q_proj", 4, 64, H), "not a PEFT LoRA config"),
    ({"lora_alpha": 8}, _pair(0, "self_attn.q_proj", 4, 64, H), "not a PEFT LoRA config"),
    (GOOD, None, "no adapter_model.safetensors"),
    (GOOD | {"use_dora": True}, _pair(0, "self_attn.q_proj", 4, 64, H), "use_dora"),
    (GOOD | {"r": 32}, _pair(0, "self_attn.q_proj", 32, 64, H), "above --max-lora-rank 16"),
    (GOOD, _pair(7, "self_attn.q_proj", 4, 64, H), "layer 7 q_proj, which this model does"),
    (GOOD, _pair(0, "self_attn.rotary", 4, 64, H), "targets 'rotary'"),
    (GOOD, _pair(0, "self_attn.q_proj", 4, 65, H), "this model needs"),
    (GOOD, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, H)}, "lm_head"),
    (GOOD, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
            torch.zeros(4, H)}, "lacks lora_B"),
], ids=["no-config", "bad-json", "no-r", "no-weights", "dora", "rank", "no-layer", "module",
        "shape", "lm-head", "half-pair"])
def test_bad_adapters_are_refused_by_name(weights, adapters, tmp_path, config, tensors, problem):
    core, _ = _lora_core(weights, adapters)
    path = _bad_adapter(tmp_path, config, tensors)
    answer = core.update_lora(LoraUpdate("x", "load", "bad", path))
    assert answer.status == (404 if config is None else 400), answer.message
    assert problem in answer.message, answer.message
    with pytest.raises(LoraError):
        core.lora.load(LoraAdapterInfo("bad", path))
    assert [i.name for i in core.stats().lora_adapters] == ["a", "b"]


def test_lora_off_refuses_adapter_requests(weights):
    core, _ = build_core(weights)
    _, last = _run(core, [_lora_request("x", PROMPTS[0], "a")])
    assert last["x"].error_status == 404
    assert core.update_lora(LoraUpdate("1", "load", "a", "/x")).status == 400


# --- the flags ----------------------------------------------------------------------------------


def test_flags_reach_the_engine_and_frontend(monkeypatch):
    from sluice import cli
    from tests.unit.cli_builders import serve_argvs

    spec = json.dumps({"name": "b", "path": "/ad/b", "base_model_name": "m"})
    argv = ["--enable-lora", "--lora-modules", "a=/ad/a", spec, "--max-loras", "3",
            "--max-lora-rank", "64", "--max-cpu-loras", "5", "--allow-runtime-lora-updating"]
    engine, frontend = serve_argvs(monkeypatch, argv)
    config = cli.engine_config(cli.parse_args(engine), "ipc:///x")
    assert config.enable_lora and (config.max_loras, config.max_lora_rank,
                                   config.max_cpu_loras) == (3, 64, 5)
    assert config.lora_modules == [LoraAdapterInfo("a", "/ad/a"),
                                   LoraAdapterInfo("b", "/ad/b", "m")]
    assert cli.frontend_config(cli.parse_args(frontend), "ipc:///x",
                               None).allow_runtime_lora_updating
    off = cli.engine_config(cli.parse_args(["engine"]), "ipc:///x")
    assert not off.enable_lora and off.lora_modules == []
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert cli.parse_args(["frontend"]).allow_runtime_lora_updating


@pytest.mark.parametrize("argv,message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
    (["--enable-lora", "--lora-modules", "=/x"], "expected name=path"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "expected {"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names an adapter twice"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras"),
    (["--enable-lora", "--max-lora-rank", "x"], "--max-lora-rank"),
])
def test_bad_flags_stop_at_start(argv, message, capsys):
    from sluice import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_batch_invariant_mode_refuses_lora():
    from engine.process.build import _lora_manager
    from shared.config import EngineConfig
    from shared.startup_checks import StartupError

    config = EngineConfig(model="m", served_model_name="m", request_address="inproc://x",
                          enable_lora=True, batch_invariant=True)
    with pytest.raises(StartupError, match="--batch-invariant"):
        _lora_manager(config, None)
