"""The flashinfer backend's step metadata, on CPU: FlashInfer's page table (qo_indptr,
kv_indptr, kv_indices, kv_last_page_len) and slot mapping for prefill, chunked prefill,
decode and mixed batches, CUDA-graph padding, backend selection and GPU cache sizing.

The last tests run the backend itself against a stand-in for the flashinfer module
(tests/unit/flashinfer_standin.py) that computes attention in torch exactly as FlashInfer
documents its wrappers (paged NHD cache, CSR page table, causal mask aligned to the end of
the context), so the metadata and the routing of rows to the prefill and decode wrappers
are checked end to end on a tiny model against the torch backend. The real kernels are
checked by tests/gpu/test_flashinfer.py.
"""

import random

import pytest
import torch

from engine.attention.flashinfer_backend import (
    PageTable,
    StepPlan,
    _rows,
    build_step_plan,
    pad_decode,
)
from engine.attention.selector import (
    BackendUnavailable,
    flashinfer_unavailable,
    select_attention_backend,
)
from engine.request.batch import ScheduledChunk
from engine.request.sequence import Sequence
from engine.step.cuda_graphs import graph_batch_sizes
from shared.protocol import SamplingParams
from tests.unit import flashinfer_standin

CPU = torch.device("cpu")


def seq(name: str, num_tokens: int, pages: list[int]) -> Sequence:
    return Sequence(
        request_id=name, token_ids=list(range(1, num_tokens + 1)), num_prompt_tokens=num_tokens,
        params=SamplingParams(max_tokens=1), reply_to="", arrival_time=0.0,
        max_output_tokens=1, pages=pages,
    )


def chunk(s: Sequence, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(s, start, num_tokens)


# ---------------------------------------------------------------- the page table


def test_prefill_from_scratch():
    plan = build_step_plan([chunk(seq("a", 10, [7, 3, 9]), 0, 10)], page_size=4)
    assert plan.slot_mapping == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37]
    assert plan.decode is None
    assert plan.prefill == PageTable(
        rows=list(range(10)), qo_indptr=[0, 10], kv_indptr=[0, 3], kv_indices=[7, 3, 9],
        kv_last_page_len=[2],
    )


def test_mixed_batch_splits_decodes_from_prefills():
    a = seq("a", 5, [2, 5])  # decode of token 4
    b = seq("b", 20, [1, 4, 6, 13, 14])  # chunked prefill, tokens 4..9 this step
    c = seq("c", 8, [0, 8, 11])  # decode of token 7: its last page just filled
    d = seq("d", 3, [12])  # new prompt
    plan = build_step_plan(
        [chunk(a, 4, 1), chunk(b, 4, 6), chunk(c, 7, 1), chunk(d, 0, 3)], page_size=4
    )
    assert plan.slot_mapping == [
        5 * 4 + 0,  # a: position 4 is page 1 ([2, 5][1]), offset 0
        4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1,  # b: 4..9
        8 * 4 + 3,  # c: position 7
        12 * 4 + 0, 12 * 4 + 1, 12 * 4 + 2,  # d: 0..2
    ]
    assert plan.decode == PageTable(
        rows=[0, 7], qo_indptr=[0, 1, 2], kv_indptr=[0, 2, 4], kv_indices=[2, 5, 0, 8],
        kv_last_page_len=[1, 4],
    )
    # b attends to its first 10 tokens (3 pages, 2 in the last); d to its 3.
    assert plan.prefill == PageTable(
        rows=[1, 2, 3, 4, 5, 6, 8, 9, 10], qo_indptr=[0, 6, 9], kv_indptr=[0, 3, 4],
        kv_indices=[1, 4, 6, 12], kv_last_page_len=[2, 3],
    )


def test_one_token_prompt_is_a_decode_of_its_only_token():
    plan = build_step_plan([chunk(seq("a", 1, [3]), 0, 1)], page_size=16)
    assert plan.prefill is None
    assert plan.decode == PageTable([0], [0, 1], [0, 1], [3], [1])
    assert plan.slot_mapping == [48]


def test_empty_step():
    assert build_step_plan([], 16) == StepPlan([], None, None)


def test_too_few_pages_is_an_error():
    with pytest.raises(ValueError, match="2 pages for 9 tokens"):
        build_step_plan([chunk(seq("a", 9, [0, 1]), 0, 9)], page_size=4)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_batches_are_consistent(page_size):
    """Whatever the mix: the tables cover every row once, each sequence's context length
    (from indptr and last_page_len) is start + num_tokens, and the slots are the pages'."""
    rng = random.Random(page_size)
    for _ in range(50):
        chunks, next_page = [], 0
        for i in range(rng.randint(1, 8)):
            end = rng.randint(1, 40)
            n = 1 if rng.random() < 0.5 else rng.randint(1, end)
            used = -(-end // page_size) + rng.randint(0, 2)  # sometimes spare pages
            pages = list(range(next_page, next_page + used))
            rng.shuffle(pages)
            next_page += used
            chunks.append(chunk(seq(str(i), end, pages), end - n, n))
        plan = build_step_plan(chunks, page_size)
        tables = [t for t in (plan.prefill, plan.decode) if t is not None]
        rows = sorted(r for t in tables for r in t.rows)
        assert rows == list(range(sum(c.num_tokens for c in chunks)))
        assert len(plan.slot_mapping) == len(rows)
        contexts = {}
        for t in tables:
            assert t.qo_indptr[-1] == len(t.rows)
            assert t.kv_indptr[-1] == len(t.kv_indices)
            for i in range(t.num_seqs):
                pages = t.kv_indices[t.kv_indptr[i] : t.kv_indptr[i + 1]]
                assert 1 <= t.kv_last_page_len[i] <= page_size
                length = (len(pages) - 1) * page_size + t.kv_last_page_len[i]
                contexts[t.rows[t.qo_indptr[i + 1] - 1]] = (pages, length)
        row = 0
        for c in chunks:
            row += c.num_tokens
            pages, length = contexts[row - 1]
            assert length == c.start + c.num_tokens
            assert pages == c.seq.pages[: len(pages)]
            for offset, pos in enumerate(range(c.start, c.start + c.num_tokens)):
                slot = plan.slot_mapping[row - c.num_tokens + offset]
                assert slot == c.seq.pages[pos // page_size] * page_size + pos % page_size


def test_rows_become_slices_where_they_can():
    assert _rows([0, 1, 2], 3, CPU) is None
    assert _rows([2, 3, 4], 6, CPU) == slice(2, 5)
    assert _rows([0, 2], 3, CPU).tolist() == [0, 2]


# ---------------------------------------------------------------- CUDA-graph padding


def test_pad_decode_sends_padding_to_the_scratch_page():
    a, b = seq("a", 6, [4, 9]), seq("b", 3, [2])
    plan = build_step_plan([chunk(a, 5, 1), chunk(b, 2, 1)], page_size=4)
    padded = pad_decode(plan, 4, scratch_page=50, page_size=4)
    assert padded.slot_mapping == [9 * 4 + 1, 2 * 4 + 2, 200, 200]
    assert padded.prefill is None
    assert padded.decode == PageTable(
        rows=[0, 1, 2, 3], qo_indptr=[0, 1, 2, 3, 4], kv_indptr=[0, 2, 3, 4, 5],
        kv_indices=[4, 9, 2, 50, 50], kv_last_page_len=[2, 3, 1, 1],
    )


def test_pad_an_empty_step_for_capture():
    padded = pad_decode(StepPlan([], None, None), 2, scratch_page=7, page_size=16)
    assert padded.slot_mapping == [112, 112]
    assert padded.decode == PageTable([0, 1], [0, 1, 2], [0, 1, 2], [7, 7], [1, 1])


def test_pad_decode_refuses_prefills_and_overflow():
    prefill = build_step_plan([chunk(seq("a", 3, [0]), 0, 3)], 4)
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode(prefill, 4, 9, 4)
    decodes = build_step_plan([chunk(seq(str(i), 2, [i]), 1, 1) for i in range(3)], 4)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode(decodes, 2, 9, 4)


def test_graph_batch_sizes():
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


# ---------------------------------------------------------------- backend selection


def test_cpu_picks_torch_and_says_why():
    choice = select_attention_backend("auto", CPU, torch.float32)
    assert choice.name == "torch"
    assert "CUDA" in choice.reason and "cpu" in choice.reason
    assert select_attention_backend("torch", CPU, torch.float32).name == "torch"


def test_flashinfer_on_cpu_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        select_attention_backend("flashinfer", CPU, torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="unknown attention backend"):
        select_attention_backend("xformers", CPU, torch.bfloat16)


def test_flashinfer_missing_or_float32_on_cuda(monkeypatch):
    import engine.attention.selector as selector

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(selector, "flashinfer_import_error", lambda: "ModuleNotFoundError: x")
    with pytest.raises(BackendUnavailable, match="pip install 'sluice\\[cuda\\]'"):
        select_attention_backend("flashinfer", cuda, torch.bfloat16)
    auto = select_attention_backend("auto", cuda, torch.bfloat16)
    assert auto.name == "torch" and "does not import" in auto.reason

    monkeypatch.setattr(selector, "flashinfer_import_error", lambda: None)
    assert select_attention_backend("auto", cuda, torch.bfloat16).name == "flashinfer"
    assert select_attention_backend("flashinfer", cuda, torch.float16).name == "flashinfer"
    assert "float32" in flashinfer_unavailable(cuda, torch.float32)
    assert select_attention_backend("auto", cuda, torch.float32).name == "torch"
    with pytest.raises(BackendUnavailable, match="--dtype bfloat16"):
        select_attention_backend("flashinfer", cuda, torch.float32)


def test_build_engine_refuses_flashinfer_on_cpu_before_loading_anything():
    from engine.process.build import build_engine
    from shared.config import EngineConfig

    config = EngineConfig(model="/nonexistent", served_model_name="x", request_address="x",
                          attention_backend="flashinfer")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        build_engine(config)


def test_gpu_cache_gets_what_weights_and_activations_leave(monkeypatch):
    from engine.process.load import gpu_activation_reserve, gpu_kv_pages
    from shared.config import EngineConfig
    from tests.unit.engine_builders import CONFIG

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    config = EngineConfig(model="m", served_model_name="m", request_address="x",
                          device="cuda", gpu_memory_utilization=0.5)
    reserve = gpu_activation_reserve(config, CONFIG, torch.bfloat16)
    per_page = 2 * CONFIG.num_layers * 16 * CONFIG.num_kv_heads * CONFIG.head_dim * 2
    expected = int(0.5 * 80 * gib - 10 * gib - reserve) // per_page
    assert gpu_kv_pages(config, CONFIG, torch.bfloat16, torch.device("cuda")) == expected
    assert gpu_kv_pages(EngineConfig(model="m", served_model_name="m", request_address="x",
                                     num_pages=7), CONFIG, torch.bfloat16, None) == 7
    with pytest.raises(SystemExit, match="gpu-memory-utilization"):
        bad = EngineConfig(model="m", served_model_name="m", request_address="x",
                           gpu_memory_utilization=1.5)
        gpu_kv_pages(bad, CONFIG, torch.bfloat16, None)


# ---------------------------------------------------------------- the backend, on a stand-in


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return flashinfer_standin.install(monkeypatch)


def _tiny_engine_parts(backend_name: str, num_pages: int = 64, page_size: int = 4):
    from engine.attention.selector import create_attention_backend
    from engine.models.llama import LlamaModel
    from tests.unit.engine_builders import CONFIG, random_weights

    model = LlamaModel(CONFIG, random_weights(), 256, torch.bfloat16, CPU)
    backend = create_attention_backend(backend_name, CONFIG, num_pages, page_size,
                                       torch.bfloat16, CPU)
    return model, backend


def _run(model, backend, chunks):
    ids = torch.tensor([t for c in chunks
                        for t in c.seq.token_ids[c.start : c.start + c.num_tokens]])
    positions = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.num_tokens)])
    with torch.inference_mode():
        return model.forward(ids, positions, backend, backend.prepare(chunks))


def _steps():
    """Three steps over four sequences: prefills (one chunked), then a mixed step
    (decodes, the rest of the chunked prefill, a new prompt), then decodes only."""
    a, b, c, d = (seq("a", 9, [0, 1, 2]), seq("b", 14, [3, 4, 5, 6]), seq("c", 5, [7, 8]),
                  seq("d", 6, [9, 10]))
    for s in (a, b, c, d):
        s.token_ids = [(7 * i + len(s.request_id) * 3 + ord(s.request_id)) % 128
                       for i in range(len(s.token_ids))]
    a.token_ids.append(5)
    c.token_ids.append(9)
    step1 = [chunk(a, 0, 9), chunk(b, 0, 6), chunk(c, 0, 5)]
    step2 = [chunk(a, 9, 1), chunk(b, 6, 8), chunk(c, 5, 1), chunk(d, 0, 6)]
    for s in (a, b, c, d):
        s.token_ids.append(11)
    step3 = [chunk(s, len(s.token_ids) - 1, 1) for s in (a, b, c, d)]
    return [step1, step2, step3]


def test_backend_matches_torch_backend_on_a_stand_in(fake_flashinfer):
    ref_model, ref_backend = _tiny_engine_parts("torch")
    model, backend = _tiny_engine_parts("flashinfer")
    assert backend.k_cache[0].shape == (65, 4, 2, 16)  # NHD, plus the scratch page
    for step in _steps():
        expected = _run(ref_model, ref_backend, step)
        got = _run(model, backend, step)
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)


def test_padded_graph_decode_matches_eager_on_a_stand_in(fake_flashinfer):
    """A decode step run through a CUDA-graph size's static metadata (padded to 8 rows,
    without the graph itself, which needs CUDA) gives the eager step's rows, and the
    padding writes only the scratch page."""
    eager_model, eager = _tiny_engine_parts("flashinfer")
    model, backend = _tiny_engine_parts("flashinfer")
    backend.enable_decode_graphs([2, 8], max_model_len=256)
    steps = _steps()
    for step in steps[:2]:
        _run(eager_model, eager, step)
        _run(model, backend, step)
    decode_step = steps[2]
    expected = _run(eager_model, eager, decode_step)

    meta = backend.prepare(decode_step)
    assert meta.graph_batch_size == 8 and backend.graph_size_for(4) == 8
    assert meta.slot_mapping.shape == (8,)
    ids = torch.zeros(8, dtype=torch.long)
    positions = torch.zeros(8, dtype=torch.long)
    for i, c in enumerate(decode_step):
        ids[i], positions[i] = c.seq.token_ids[c.start], c.start
    with torch.inference_mode():
        got = model.forward(ids, positions, backend, meta)[:4]
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)
    for layer in range(len(backend.k_cache)):
        torch.testing.assert_close(backend.k_cache[layer][:-1], eager.k_cache[layer][:-1])
    assert backend.k_cache[0][-1].abs().sum() > 0  # padding wrote its scratch slot
    assert backend.graph_size_for(9) == 0  # larger batches run eagerly
