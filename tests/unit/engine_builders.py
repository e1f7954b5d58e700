"""Builders for engine tests: a tiny random Llama (`CONFIG`, `random_weights`, and
`hf_config_kwargs` for transformers' side of it), an EngineCore
on it that records logits and plans (`build_core`), requests, and drivers that run a core to
the end and collect what each request produced. Shared by the engine's unit tests."""

from collections import defaultdict

import msgspec
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.config import ModelConfig
from engine.models.llama import LlamaModel
from engine.models.registry import expected_shapes
from engine.step.core import EngineCore
from engine.step.kv_cache import PageAllocator
from engine.step.model_runner import ModelRunner
from engine.step.scheduler import Scheduler
from engine.step.spec_decode import Drafter
from shared.protocol import EngineRequest, SamplingParams, pack_ids, unpack_ids
from shared.speculative import SpeculativeConfig

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
VOCAB = CONFIG.vocab_size
CPU = torch.device("cpu")


def hf_config_kwargs(**overrides) -> dict:
    """The tiny Llama's shape in transformers' config names, for tests that build an HF
    model of it (a twin to compare with, or a folder to load); `overrides` add or replace
    fields. No head_dim unless given: each family derives its own."""
    return dict(
        vocab_size=CONFIG.vocab_size,
        hidden_size=CONFIG.hidden_size,
        intermediate_size=CONFIG.intermediate_size,
        num_hidden_layers=CONFIG.num_layers,
        num_attention_heads=CONFIG.num_heads,
        num_key_value_heads=CONFIG.num_kv_heads,
    ) | overrides


def random_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in expected_shapes(CONFIG).items():
        if len(shape) == 1:  # norms: around 1, but not exactly, so a missed one shows
            out[name] = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=gen)
        else:  # Linear [out, in]: unit-variance outputs keep logits well spread
            out[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return out


# A one-layer model over SmolLM2's real vocabulary, for tests that need its tokenizer (grammars
# compiled against it): its EOS, config, and weights that keep every logit finite.
SMOLLM2_EOS = 2  # <|im_end|>
SMOLLM2_VOCAB_CONFIG = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
)


def smollm2_vocab_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) * (0.5 if len(shape) == 2 else 0.0) + (
        1.0 if len(shape) == 1 else 0.0)
        for name, shape in expected_shapes(SMOLLM2_VOCAB_CONFIG).items()}

class Recorder:
    """Logits of every sampled row and every scheduler plan, per request id."""

    def __init__(self) -> None:
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.preemptions = 0
        self.chunked = 0  # prefill chunks that continued an earlier one
        self.max_batch = 0


def build_core(
    weights,
    *,
    num_pages: int = 256,
    page_size: int = 4,
    budget: int = 512,
    max_num_seqs: int = 32,
    max_model_len: int = 256,
    eos: tuple[int, ...] = (),
    policy: str = "fcfs",
    speculative: SpeculativeConfig | None = None,
    kv=None,  # a narrow KV cache (engine.attention.kv_dtype.KvCacheDtype)
) -> tuple[EngineCore, Recorder]:
    rec = Recorder()
    model = LlamaModel(CONFIG, weights, max_model_len, torch.float32, CPU)
    backend = TorchAttentionBackend(
        CONFIG.num_layers,
        num_pages,
        page_size,
        CONFIG.num_kv_heads,
        CONFIG.head_dim,
        torch.float32,
        CPU,
        kv=kv,
    )
    runner = ModelRunner(model, backend, VOCAB)
    allocator = PageAllocator(num_pages, page_size)
    drafter = Drafter(speculative) if speculative is not None else None
    scheduler = Scheduler(allocator, budget, max_num_seqs, policy, drafter=drafter)

    pending_ids: list[str] = []
    model_logits = model.logits

    def logits(hidden):
        out = model_logits(hidden)
        if drafter is not None and out.shape[0] != len(pending_ids):
            return out  # the draft rows of a verifying step (engine.step.spec_decode)
        assert out.shape[0] == len(pending_ids)
        for request_id, row in zip(pending_ids, out, strict=True):
            rec.logits[request_id].append(row.clone())
        return out

    model.logits = logits
    runner_execute = runner.execute

    def execute(chunks):
        pending_ids[:] = [c.seq.request_id for c in chunks if c.samples]
        rec.chunked += sum(
            1 for c in chunks if 0 < c.start < c.seq.num_prompt_tokens and c.num_tokens > 1
        )
        rec.max_batch = max(rec.max_batch, len(chunks))
        return runner_execute(chunks)

    runner.execute = execute
    schedule = scheduler.schedule

    def recording_schedule():
        plan = schedule()
        rec.preemptions += len(plan.preempted)
        return plan

    scheduler.schedule = recording_schedule
    core = EngineCore(
        runner,
        allocator,
        scheduler,
        eos_token_ids=list(eos),
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        engine_id="test-engine",
        model_name="tiny",
    )
    return core, rec


def request(request_id: str, prompt, reply_to: str = "tcp://frontend",
            cache_salt: str | None = None, **params) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 12)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=pack_ids(prompt),
        params=SamplingParams(**params),
        reply_to=reply_to,
        arrival_time=0.0,
        cache_salt=cache_salt,
    )


class Result(msgspec.Struct):
    tokens: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    error_status: int = 0
    num_prompt_tokens: int = 0
    num_outputs: int = 0
    first_token_times: int = 0


def collect(results: dict[str, Result], outputs) -> None:
    for reply_to, out in outputs:
        assert reply_to == "tcp://frontend"
        r = results.setdefault(out.request_id, Result())
        assert r.finish_reason is None, f"{out.request_id} reported after finishing"
        new = unpack_ids(out.new_token_ids).tolist()
        r.tokens.extend(new)
        assert out.num_output_tokens == len(r.tokens)
        r.num_prompt_tokens = out.num_prompt_tokens
        r.finish_reason, r.stop_reason = out.finish_reason, out.stop_reason
        r.error, r.error_status = out.error, out.error_status
        r.num_outputs += 1
        if out.first_token_time is not None:
            r.first_token_times += 1
            assert new and len(r.tokens) == len(new), "first_token_time on a later output"


def drain(core: EngineCore, results: dict[str, Result] | None = None, max_steps=2000):
    results = {} if results is None else results
    steps = 0
    while core.has_work:
        collect(results, core.step())
        steps += 1
        assert steps < max_steps
    return results


def run(core: EngineCore, requests, arrivals=None) -> dict[str, Result]:
    """Add requests (at step `arrivals[i]` if given) and step until everything is done."""
    arrivals = arrivals or [0] * len(requests)
    todo = sorted(zip(arrivals, range(len(requests)), requests, strict=True))
    results: dict[str, Result] = {}
    step = 0
    while todo or core.has_work:
        while todo and todo[0][0] <= step:
            core.add(todo.pop(0)[2])
        collect(results, core.step())
        step += 1
        assert step < 2000
    assert_all_free(core)
    return results


def assert_all_free(core: EngineCore) -> None:
    assert core.allocator.num_free == core.allocator.num_pages
    assert not core.scheduler.running and not core.scheduler.waiting
    assert not core.sequences


def prompts(lengths, seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def greedy_tokens(core: EngineCore, prompts, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (`max_tokens`, EOS ignored) from `core`, all added at once
    and stepped to the end: what `sluice serve DIR`'s engine gives a batch."""
    for i, prompt in enumerate(prompts):
        core.add(EngineRequest(
            request_id=f"r{i}", prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            arrival_time=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for _, out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(unpack_ids(out.new_token_ids).tolist())
    return [tokens[f"r{i}"] for i in range(len(prompts))]
