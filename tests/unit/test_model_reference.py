"""Reference tests: our Llama-family model, loaded from an HF safetensors folder by our own
loader and served by EngineCore (paged torch attention, chunked prefill, batching), against
transformers in float32, for Llama (untied and tied), Qwen2 (q/k/v bias) and Qwen3 (q/k norm,
head_dim != hidden / heads). Random weights, no checkpoint download, no sockets."""

from collections import defaultdict

import pytest
import torch
import transformers

from engine.attention.selector import create_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_kernels import kernels
from engine.layers.cpu_ops import CpuKernelOps
from engine.models.registry import (
    build_model,
    load_model_config,
    load_quantized_weights,
    load_weights,
)
from engine.step.core import EngineCore
from engine.step.kv_cache import PageAllocator
from engine.step.model_runner import ModelRunner
from engine.step.scheduler import Scheduler
from shared.protocol import EngineRequest, SamplingParams, pack_ids, unpack_ids
from tests.unit.engine_builders import hf_config_kwargs

CPU = torch.device("cpu")
VOCAB = 256
STEPS = 24
PAGE_SIZE = 4
BUDGET = 8  # every prompt longer than this is prefilled in several chunks
MAX_MODEL_LEN = 128
NUM_PAGES = 64  # all prompts at once need ~40 pages: no preemption here
# A one-token prompt, one that fills whole pages and whole budgets, and one of 4 chunks.
PROMPT_LENGTHS = [1, 6, 16, 27]

TINY = hf_config_kwargs(
    vocab_size=VOCAB,
    num_hidden_layers=3,
    max_position_embeddings=MAX_MODEL_LEN,
    rms_norm_eps=1e-5,
    # Not the default: a loader that ignored it would rotate every position wrongly.
    rope_theta=1000.0,
    # No EOS anywhere: both sides generate STEPS tokens whatever comes out.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"tie_word_embeddings": True},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # head_dim 32 with 4 heads: q is 128 wide on a 64-wide model, so o_proj is not square.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    # Qwen3's small checkpoints (0.6B-4B) tie their embeddings.
    "qwen3-tied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"head_dim": 32, "tie_word_embeddings": True},
    ),
}
EXPECTED = {  # (architecture, attention_bias, qk_norm, tied, head_dim)
    "llama": ("llama", False, False, False, 16),
    "llama-tied": ("llama", False, False, True, 16),
    "qwen2": ("qwen2", True, False, False, 16),
    "qwen3": ("qwen3", False, True, False, 32),
    "qwen3-tied": ("qwen3", False, True, True, 32),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights that keep activations O(1) and logits well spread."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = param.shape
            if name == "model.norm.weight":
                # Gains in [1.5, 4.5] spread the logits (std ~3), so greedy ties are rare.
                value = 3 * (0.5 + torch.rand(shape, generator=gen))
            elif name.endswith("norm.weight"):
                # Per-channel gains in [0.5, 1.5]: a skipped or misplaced norm shows.
                value = 0.5 + torch.rand(shape, generator=gen)
            elif name.endswith((".bias", "sinks")):
                value = 0.5 * torch.randn(shape, generator=gen)
            else:
                # Linear [out, in]: unit-variance outputs. The embedding too: at unit scale a
                # tied head mostly scores the current token and greedy repeats it forever.
                value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            param.copy_(value)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


class Reference:
    def __init__(self, path, prompts, tokens, step_logits, first_logits):
        self.path = path
        self.prompts = prompts
        self.tokens = tokens  # per prompt: STEPS greedy tokens from generate()
        self.step_logits = step_logits  # per prompt: [STEPS, VOCAB] from generate()
        self.first_logits = first_logits  # per prompt: [VOCAB] from a full forward


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request, tmp_path_factory) -> tuple[str, Reference]:
    case = request.param
    config_cls, model_cls, overrides = CASES[case]
    path = tmp_path_factory.mktemp(case)
    return case, make_reference(path, config_cls, model_cls, {**TINY, **overrides}, seed=8)


def make_reference(path, config_cls, model_cls, config_kwargs: dict, seed: int,
                   prepare=None) -> Reference:
    """A random-weight transformers model saved under `path`, and its greedy generations
    (transformers' eager attention: the reference arithmetic) for the test prompts.
    prepare(model): sets weights of its own after the random draw."""
    hf_config = config_cls(**config_kwargs)
    model = model_cls._from_config(hf_config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    _randomize(model, seed=seed)  # seed 8: every Llama-family case's top-2 gaps > 5e-3
    if prepare is not None:
        prepare(model)
    if hf_config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(path, safe_serialization=True)
    assert (path / "model.safetensors").is_file()

    prompts = _prompts(seed=7)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tokens, step_logits, first_logits = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=STEPS,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
            generated = out.sequences[0, len(prompt) :].tolist()
            assert len(generated) == STEPS
            logits = torch.cat(out.logits).float()  # [STEPS, VOCAB], raw (before processors)
            # Greedy with nothing altering the scores: each token is its step's argmax.
            assert logits.argmax(-1).tolist() == generated
            tokens.append(generated)
            step_logits.append(logits)
            first_logits.append(model(ids).logits[0, -1].float())
    return Reference(str(path), prompts, tokens, step_logits, first_logits)


def test_reference_is_not_degenerate(reference):
    """Guards for the comparisons below: no greedy near-ties, varied and spread outputs."""
    _, ref = reference
    for logits in ref.step_logits:
        top2 = logits.topk(2, dim=-1).values
        # Float noise between two correct implementations is ~1e-6; a flip needs a near-tie.
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
        assert logits.std() > 0.5
    assert len({t for seq in ref.tokens for t in seq}) > 15
    # Different prompts, different continuations.
    assert len({tuple(seq) for seq in ref.tokens}) == len(ref.tokens)


def test_loaded_config_matches(reference):
    case, ref = reference
    config = load_model_config(ref.path)
    arch, bias, qk_norm, tied, head_dim = EXPECTED[case]
    assert (config.architecture, config.attention_bias, config.qk_norm) == (arch, bias, qk_norm)
    assert (config.tie_word_embeddings, config.head_dim) == (tied, head_dim)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (3, 4, 2)
    assert config.rope_theta == 1000.0 and config.rms_norm_eps == 1e-5
    assert config.rope_scaling is None


# --- our engine -------------------------------------------------------------------------------


def _build_core(
    path: str, budget: int, compiled=None, quantized=False
) -> tuple[EngineCore, dict[str, list[torch.Tensor]]]:
    """EngineCore around our model loaded from `path`; records every sampled row's logits.
    compiled: the CPU kernels module to run with, or None for plain torch ops; quantized:
    hand the model a GGUF's block-quantized weights, as build_engine does."""
    config = load_model_config(path)
    ops = CpuKernelOps(compiled) if compiled is not None else None
    # Experts left in the memory-mapped checkpoint, as build_engine leaves them; a GGUF's
    # block experts, where the kernels take them, not dequantized at all.
    as_blocks = torch.float32 if quantized and ops is not None else None
    weights = load_weights(path, config, torch.float32, map_experts_as=torch.float32,
                           experts_as_blocks=as_blocks)
    blocks = load_quantized_weights(path, config) if quantized else None
    model = build_model(config, weights, MAX_MODEL_LEN, torch.float32, CPU, ops=ops,
                        quantized=blocks)
    backend = TorchAttentionBackend(
        config.num_layers,
        NUM_PAGES,
        PAGE_SIZE,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        CPU,
        kernels=compiled,
        layers=config.layer_attention,
    ) if config.mla is None else create_attention_backend(  # a latent cache (DeepSeek)
        "torch", config, NUM_PAGES, PAGE_SIZE, torch.float32, CPU)
    runner = ModelRunner(model, backend, config.vocab_size)
    allocator = PageAllocator(NUM_PAGES, PAGE_SIZE)
    # As build_engine does: a model windowed in every layer releases the pages behind it.
    scheduler = Scheduler(allocator, budget, max_num_seqs=16, kv_window=config.kv_window)

    recorded: dict[str, list[torch.Tensor]] = defaultdict(list)
    sampling_ids: list[str] = []
    model_logits, runner_execute = model.logits, runner.execute

    def logits(hidden):
        out = model_logits(hidden)
        # No request asks for prompt logprobs: every call is for the sampled rows.
        assert out.shape == (len(sampling_ids), config.vocab_size)
        for request_id, row in zip(sampling_ids, out, strict=True):
            recorded[request_id].append(row.clone())
        return out

    def execute(chunks):
        sampling_ids[:] = [c.seq.request_id for c in chunks if c.samples]
        return runner_execute(chunks)

    model.logits = logits
    runner.execute = execute
    core = EngineCore(
        runner,
        allocator,
        scheduler,
        eos_token_ids=[],
        max_model_len=MAX_MODEL_LEN,
        vocab_size=config.vocab_size,
        engine_id="reference-test",
        model_name="tiny",
    )
    return core, recorded


def _request(request_id: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=pack_ids(prompt),
        params=SamplingParams(max_tokens=STEPS, temperature=0.0),
        reply_to="tcp://test",
        arrival_time=0.0,
    )


def _drain(core: EngineCore, tokens: dict[str, list[int]]) -> None:
    steps = 0
    while core.has_work:
        for _, out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(unpack_ids(out.new_token_ids).tolist())
            if out.finish_reason is not None:
                assert out.finish_reason == "length"
        steps += 1
        assert steps < 1000


def _run(path: str, prompts, mode: str, compiled=None, quantized=False):
    """Greedy tokens and sampled-row logits per prompt index, run as `mode` says."""
    budget = 256 if mode == "single-chunk" else BUDGET
    core, recorded = _build_core(path, budget, compiled, quantized)
    tokens: dict[str, list[int]] = defaultdict(list)
    ids = [f"r{i}" for i in range(len(prompts))]
    if mode == "alone":
        for request_id, prompt in zip(ids, prompts, strict=True):
            core.add(_request(request_id, prompt))
            _drain(core, tokens)
    else:
        for request_id, prompt in zip(ids, prompts, strict=True):
            core.add(_request(request_id, prompt))
        _drain(core, tokens)
    if mode == "prefix-cached":
        # The same prompts again, all at once, on the warm engine: full pages of each prompt
        # come from the prefix cache and only the rest is prefilled.
        hits = core.allocator.prefix_hits
        recorded.clear()
        tokens.clear()
        for request_id, prompt in zip(ids, prompts, strict=True):
            core.add(_request(request_id, prompt))
        _drain(core, tokens)
        assert core.allocator.prefix_hits > hits
    assert core.allocator.num_free == core.allocator.num_pages and not core.sequences
    return (
        [tokens[i] for i in ids],
        [torch.stack(recorded[i]) for i in ids],
        core.num_steps,
    )


MODES = ["alone", "together", "single-chunk", "prefix-cached"]


@pytest.mark.parametrize("ops", ["torch", "cpu-kernels"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_transformers(reference, mode, ops):
    _, ref = reference
    compiled = None
    if ops == "cpu-kernels":
        compiled = kernels()
        if compiled is None:
            pytest.skip("the CPU kernels do not build here (tests/unit/test_cpu_kernels.py)")
    tokens, logits, num_steps = _run(ref.path, ref.prompts, mode, compiled)
    if mode == "single-chunk":
        # Every prompt prefilled whole, all in the first step.
        assert num_steps == STEPS
    else:
        assert num_steps > STEPS
    for i, prompt in enumerate(ref.prompts):
        assert logits[i].shape == (STEPS, VOCAB), f"prompt {i}"
        # First step: the last prompt position, against a plain full forward.
        torch.testing.assert_close(logits[i][0], ref.first_logits[i], atol=1e-4, rtol=0)
        # Every step, against generate()'s own logits.
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i], f"prompt {i} (length {len(prompt)})"
