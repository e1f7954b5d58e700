"""The CUDA path on a real GPU: FlashInfer attention, fused kernels, CUDA graphs.

Skipped (with the reason) where there is no CUDA device or flashinfer is not installed;
`benchmarks/gpu_check.sh` runs it on a GPU machine, on a random-weight model of the default
model's shape ($SLUICE_GPU_MODEL; tests/gpu/model.py). Each engine starts once per module.

- Greedy tokens of a GPU engine against HF transformers on the same GPU, on the prompts of
  tests/integration/test_reference.py, one at a time and all at once: the torch backend in
  float32 against transformers float32, and the flashinfer backend in bfloat16 (with and
  without CUDA graphs) against transformers bfloat16. Across devices and
  kernels, exact equality is not a fair bar: the tokens must agree until the first place
  where transformers' own top two logits are within a small margin (a near tie), and after
  such a place the two continuations may legitimately differ.
- Logits, in process on one GPU, teacher-forced through prefill, chunked prefill, mixed
  and decode-only steps: the flashinfer backend (eager and CUDA-graph) in bfloat16 must be
  about as close to a float32 torch-backend reference as the torch backend in bfloat16 is.
- Sampling on CUDA (FlashInfer's top-k/top-p kernel, seeded rows, penalties, logit bias,
  logprobs) runs and seeded requests repeat.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)",
                allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed (the `cuda` extra)")

from shared.protocol import SamplingParams  # noqa: E402
from shared.transport import free_tcp_port  # noqa: E402
from tests.engine_client import RawEngineClient  # noqa: E402
from tests.gpu.model import gpu_model_path, load_hf_model  # noqa: E402
from tests.integration.test_reference import (  # noqa: E402
    GREEDY,
    NEW_TOKENS,
    reference_prompts,
)
from tests.servers import Proc  # noqa: E402

pytestmark = [pytest.mark.slow]

# An engine start: weights, KV cache, CUDA-graph capture. Without prebuilt kernels
# (benchmarks/gpukit/kernels.py) FlashInfer compiles on first use, which takes minutes.
ENGINE_START_TIMEOUT_S = float(os.environ.get("SLUICE_GPU_START_TIMEOUT", "600"))
NUM_KV_PAGES = "2048"  # fixed, so engines alive at once do not size against each other
FP32_MARGIN = 1e-2  # logits; GPU vs CPU float32 differ by ~1e-5
BF16_MARGIN = 1.0  # logits; two bfloat16 implementations differ by tenths


# ---------------------------------------------------------------- helpers


class GpuEngine:
    """`sluice engine --device cuda ...` on loopback, waited for until it is ready."""

    def __init__(self, tmp_dir: str, name: str, *args: str) -> None:
        self.address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.proc = Proc(
            ["engine", "--model", gpu_model_path(), "--engine-address", self.address,
             "--device", "cuda", "--max-num-batched-tokens", "256",
             "--num-kv-pages", NUM_KV_PAGES, *args],
            os.path.join(tmp_dir, f"{name}.log"),
        )
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while "engine listening on" not in self.proc.log():
            if self.proc.popen.poll() is not None or time.monotonic() > deadline:
                log = self.proc.log()
                self.proc.stop()
                raise RuntimeError(f"engine {name} did not start:\n{log[-6000:]}")
            time.sleep(1)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 together: bool) -> list[list[int]]:
        client = RawEngineClient(self.address)
        try:
            if together:
                return client.generate(prompts, params, timeout_s=600)
            return [client.generate([p], params, timeout_s=600)[0] for p in prompts]
        finally:
            client.close()

    def stop(self) -> str:
        self.proc.stop()
        return self.proc.log()


def hf_greedy(prompts, dtype: torch.dtype, device: str):
    """transformers' greedy tokens and the logits it chose them from."""
    model = load_hf_model(gpu_model_path(), dtype).to(device)
    tokens, scores = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True,
            )
            tokens.append(out.sequences[0, len(ids):].tolist())
            scores.append(torch.cat(out.scores).float().cpu())  # [NEW_TOKENS, vocab]
    del model
    torch.cuda.empty_cache()
    return tokens, scores


def divergence(ours: list[int], theirs: list[int], scores: torch.Tensor,
               margin: float) -> str | None:
    """None when `ours` follows transformers' greedy tokens up to the end or up to a near tie
    (transformers' logit for its token within `margin` of its logit for ours)."""
    assert len(ours) == len(theirs) == NEW_TOKENS
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            gap = float(scores[i, b] - scores[i, a])
            if gap <= margin:
                return None
            return f"token {i}: ours {a}, transformers {b}, logit gap {gap:.4f} > {margin}"
    return None


def assert_follows(ours, reference, margin: float) -> None:
    tokens, scores = reference
    problems = []
    for i, (mine, theirs, s) in enumerate(zip(ours, tokens, scores, strict=True)):
        why = divergence(mine, theirs, s, margin)
        if why:
            problems.append(f"prompt {i}: {why}")
    exact = sum(m == t for m, t in zip(ours, tokens, strict=True))
    print(f"{exact}/{len(tokens)} prompts match transformers exactly")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- greedy vs transformers


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return reference_prompts(gpu_model_path())


@pytest.fixture(scope="module")
def hf_float32(prompts):
    return hf_greedy(prompts, torch.float32, "cuda")


@pytest.fixture(scope="module")
def hf_bfloat16(prompts):
    return hf_greedy(prompts, torch.bfloat16, "cuda")


@pytest.fixture(scope="module")
def torch_float32_engine(tmp_path_factory):
    engine = GpuEngine(str(tmp_path_factory.mktemp("torch")), "torch-fp32", "--dtype",
                       "float32", "--attention-backend", "torch")
    yield engine
    engine.stop()


@pytest.fixture(scope="module", params=[False, True], ids=["cuda-graphs", "eager"])
def flashinfer_engine(request, tmp_path_factory):
    """`--attention-backend auto` in bfloat16, which must pick flashinfer on a CUDA device
    with flashinfer installed; with CUDA graphs, then without."""
    eager = request.param
    engine = GpuEngine(str(tmp_path_factory.mktemp("flashinfer")), "flashinfer-bf16",
                       "--dtype", "bfloat16", "--attention-backend", "auto",
                       *(["--enforce-eager"] if eager else []))
    engine.eager = eager
    yield engine
    engine.stop()


@pytest.mark.parametrize("together", [False, True], ids=["one-at-a-time", "all-at-once"])
def test_torch_backend_float32_on_gpu_matches_transformers(torch_float32_engine, prompts,
                                                           hf_float32, together):
    ours = torch_float32_engine.generate(prompts, GREEDY, together)
    assert "attention backend: torch" in torch_float32_engine.proc.log()
    assert_follows(ours, hf_float32, FP32_MARGIN)


@pytest.mark.parametrize("together", [False, True], ids=["one-at-a-time", "all-at-once"])
def test_flashinfer_bfloat16_matches_transformers(flashinfer_engine, prompts, hf_bfloat16,
                                                  together):
    ours = flashinfer_engine.generate(prompts, GREEDY, together)
    log = flashinfer_engine.proc.log()
    assert "attention backend: flashinfer" in log
    assert ("captured decode CUDA graphs" in log) != flashinfer_engine.eager
    assert_follows(ours, hf_bfloat16, BF16_MARGIN)


def test_flashinfer_on_float32_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        GpuEngine(str(tmp_path), "fp32-flashinfer", "--dtype", "float32",
                  "--attention-backend", "flashinfer")


# ---------------------------------------------------------------- sampling on CUDA


def test_sampling_on_cuda(flashinfer_engine, prompts):
    engine = flashinfer_engine
    top = SamplingParams(max_tokens=32, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True)
    plain = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.8, seed=1234,
                            ignore_eos=True)
    fancy = SamplingParams(max_tokens=32, temperature=0.7, min_p=0.05, repetition_penalty=1.2,
                           presence_penalty=0.5, frequency_penalty=0.3, logit_bias=[(42, 5.0)],
                           logprobs=5, ignore_eos=True)
    batch = prompts[:4]
    for params in (top, plain, fancy):
        for out in engine.generate(batch, params, together=True):
            assert len(out) == 32 and all(0 <= t < 49152 for t in out)
    # Alone each time, so the batch (and with it the kernels' numerics) is the same.
    first = engine.generate(batch[:2], seeded, together=False)
    again = engine.generate(batch[:2], seeded, together=False)
    assert again == first, "a seeded request repeats"


# ---------------------------------------------------------------- logits, in process


class Path:
    """One way to run the model: dtype, attention backend and ops, optionally graphs."""

    def __init__(self, weights, model_config, backend_name, dtype, num_pages, page_size,
                 graphs=False):
        from engine.attention.selector import create_attention_backend
        from engine.layers.ops import make_ops
        from engine.models.llama import LlamaModel
        from engine.step.cuda_graphs import DecodeGraphModel, graph_batch_sizes

        device = torch.device("cuda")
        self.model = LlamaModel(model_config, weights, 2048, dtype, device,
                                ops=make_ops(backend_name, device))
        self.backend = create_attention_backend(backend_name, model_config, num_pages,
                                                page_size, dtype, device)
        if graphs:
            self.model = DecodeGraphModel(self.model, self.backend, graph_batch_sizes(16),
                                          2048)
            self.model.capture()

    @torch.inference_mode()
    def step(self, chunks) -> torch.Tensor:
        ids, positions, rows = [], [], []
        for c in chunks:
            end = c.start + c.num_tokens
            ids.extend(c.seq.token_ids[c.start:end])
            positions.extend(range(c.start, end))
            rows.append(len(ids) - 1)
        dev = "cuda"
        meta = self.backend.prepare(chunks)
        hidden = self.model.forward(torch.tensor(ids, device=dev),
                                    torch.tensor(positions, device=dev), self.backend, meta)
        return self.model.logits(hidden[torch.tensor(rows, device=dev)]).float()


def test_logits_flashinfer_vs_torch_backend(prompts):
    from engine.models.registry import load_model_config, load_weights
    from engine.request.batch import ScheduledChunk
    from engine.request.sequence import Sequence

    path = gpu_model_path()
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32)
    page_size, num_pages = 16, 1024
    paths = {
        "torch-fp32": Path(weights, config, "torch", torch.float32, num_pages, page_size),
        "torch-bf16": Path(weights, config, "torch", torch.bfloat16, num_pages, page_size),
        "flashinfer-bf16": Path(weights, config, "flashinfer", torch.bfloat16, num_pages,
                                page_size),
        "flashinfer-graphs": Path(weights, config, "flashinfer", torch.bfloat16, num_pages,
                                  page_size, graphs=True),
    }
    # Eight sequences admitted two per step, prefilled in chunks of at most 256 tokens,
    # then decoded: steps mix prefill, chunked prefill and decodes, and end decode-only.
    seqs, next_page = [], 0
    for i, ids in enumerate(prompts):
        pages_needed = -(-(len(ids) + 24) // page_size)
        seqs.append(Sequence(
            request_id=str(i), token_ids=list(ids), num_prompt_tokens=len(ids),
            params=SamplingParams(max_tokens=24), reply_to="", arrival_time=0.0,
            max_output_tokens=24, pages=list(range(next_page, next_page + pages_needed)),
        ))
        next_page += pages_needed
    errors = {name: [] for name in paths}
    agree = {name: 0 for name in paths}
    rows_total = 0
    for step in range(60):
        active = [s for s in seqs[: 2 * (step + 1)] if s.num_output_tokens < 16]
        if not active:
            break
        chunks = [ScheduledChunk(s, s.num_computed, min(256, s.num_uncomputed))
                  for s in active]
        # Logits of each chunk's last fed position (mid-prompt ones predict the prompt).
        logits = {name: p.step(chunks) for name, p in paths.items()}
        reference = logits["torch-fp32"]
        for name, got in logits.items():
            errors[name].append((got - reference).abs().max().item())
            agree[name] += int((got.argmax(-1) == reference.argmax(-1)).sum())
        rows_total += len(chunks)
        best = reference.argmax(-1).tolist()
        for i, c in enumerate(chunks):
            c.seq.num_computed += c.num_tokens
            if c.samples:
                c.seq.token_ids.append(best[i])  # teacher-forced: every path sees the same
    assert paths["flashinfer-graphs"].model.replays > 0, "no decode step ran as a graph"
    worst = {name: max(e) for name, e in errors.items()}
    print("max |logit - float32 reference| per path:", worst)
    print("argmax agreement:", {n: f"{a}/{rows_total}" for n, a in agree.items()})
    baseline = worst["torch-bf16"]
    for name in ("flashinfer-bf16", "flashinfer-graphs"):
        assert worst[name] <= 1.5 * baseline + 0.1, (name, worst)
        assert agree[name] >= 0.97 * agree["torch-bf16"] - 1, (name, agree)
