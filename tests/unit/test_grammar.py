"""engine.request.grammar and the engine's use of it: masks, matcher advance, compile off the step
loop, invalid grammars, aborts and preemption, on a tiny random Llama with the real SmolLM2
tokenizer (llguidance needs real token bytes). No sockets."""

import json
import re
import threading
import time

import numpy as np
import pytest
import torch
from llguidance import grammar_from

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.llama import LlamaModel
from engine.request.grammar import GrammarBackend
from engine.step.core import EngineCore
from engine.step.kv_cache import PageAllocator
from engine.step.model_runner import ModelRunner
from engine.step.scheduler import Scheduler
from shared.model_source import default_model_path
from shared.protocol import Constraint, EngineRequest, SamplingParams, pack_ids, unpack_ids
from shared.tokenizer import load_tokenizer
from tests.unit.engine_builders import SMOLLM2_EOS, SMOLLM2_VOCAB_CONFIG, smollm2_vocab_weights

EOS = SMOLLM2_EOS
CONFIG = SMOLLM2_VOCAB_CONFIG


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, CONFIG.vocab_size, [EOS], mask_threads=1)


@pytest.fixture(scope="module")
def weights():
    return smollm2_vocab_weights()


def regex(pattern: str) -> Constraint:
    return Constraint("regex", grammar_from("regex", pattern))


def choice(*options: str) -> Constraint:
    return Constraint("choice", grammar_from("choice", json.dumps(list(options))))


def ready(backend: GrammarBackend, constraint: Constraint):
    grammar = backend.compile(constraint)
    while not grammar.compiled:
        time.sleep(0.001)
    assert grammar.poll() is None
    return grammar


# ---------------------------------------------------------------- the backend alone


def allowed(backend, grammar) -> set[int]:
    masks = backend.fill_masks([None, grammar])
    assert masks.rows == [1]
    logits = torch.zeros(2, CONFIG.vocab_size)
    backend.apply_masks(logits, masks)
    assert torch.isfinite(logits[0]).all()  # an unconstrained row is untouched
    return set(torch.isfinite(logits[1]).nonzero().squeeze(1).tolist())


def test_mask_allows_exactly_the_grammars_next_tokens(backend, tokenizer):
    grammar = ready(backend, choice("yes", "no"))
    first = allowed(backend, grammar)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert EOS not in first  # nothing chosen yet: the grammar is not complete


def test_matcher_advances_and_stops_when_complete(backend, tokenizer):
    grammar = ready(backend, choice("yes", "no"))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert token in allowed(backend, grammar)
        assert grammar.advance(token)
    assert grammar.is_stopped


def test_accepting_grammar_allows_eos_and_rejects_what_it_forbids(backend, tokenizer):
    grammar = ready(backend, regex("[a-z]+"))
    assert grammar.advance(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert EOS in allowed(backend, grammar)
    assert not grammar.advance(tokenizer.encode("7", add_special_tokens=False)[0])


def test_invalid_grammar_reports_llguidances_message(backend):
    grammar = backend.compile(Constraint("regex", grammar_from("regex", "[a-z+")))
    while not grammar.compiled:
        time.sleep(0.001)
    assert "unclosed character class" in grammar.poll()
    assert not grammar.ready


# ---------------------------------------------------------------- inside the engine


def build_core(weights, backend, *, num_pages=256, page_size=4, budget=512):
    model = LlamaModel(CONFIG, weights, 256, torch.float32, torch.device("cpu"))
    attn = TorchAttentionBackend(1, num_pages, page_size, 1, 16, torch.float32,
                                 torch.device("cpu"))
    allocator = PageAllocator(num_pages, page_size)
    return EngineCore(
        ModelRunner(model, attn, CONFIG.vocab_size), allocator,
        Scheduler(allocator, budget, 32), eos_token_ids=[EOS], max_model_len=256,
        vocab_size=CONFIG.vocab_size, engine_id="t", model_name="tiny", grammar=backend,
    )


def request(request_id, prompt, constraint=None, **params):
    params.setdefault("max_tokens", 24)
    return EngineRequest(
        request_id=request_id, prompt_token_ids=pack_ids(prompt),
        params=SamplingParams(constraint=constraint, **params), reply_to="inproc://r",
        arrival_time=0.0,
    )


def text(tokenizer, tokens: list[int]) -> str:
    """The answer without its final EOS, which a finished grammar forces."""
    assert tokens[-1] == EOS
    return tokenizer.decode(tokens[:-1])


def run(core, limit=400):
    done, tokens = {}, {}
    for _ in range(limit):
        for _, out in core.step():
            tokens.setdefault(out.request_id, []).extend(unpack_ids(out.new_token_ids).tolist())
            if out.finish_reason is not None:
                done[out.request_id] = out
        if not core.has_work:
            break
    return done, tokens


def test_constrained_outputs_follow_the_grammar(weights, backend, tokenizer):
    core = build_core(weights, backend)
    core.add(request("free", [1, 2, 3]))
    core.add(request("choice", [1, 2, 3], choice("apple", "banana", "cherry"), temperature=1.0,
                     seed=3))
    core.add(request("digits", [4, 5], regex("[0-9]{3}-[0-9]{2}"), temperature=1.0, seed=4))
    done, tokens = run(core)
    assert text(tokenizer, tokens["choice"]) in ("apple", "banana", "cherry")
    assert done["choice"].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", text(tokenizer, tokens["digits"]))
    assert done["free"].finish_reason == "length"  # the random model never says EOS
    assert not core.sequences and not core._compiling


def test_a_finished_grammar_ends_the_answer_despite_min_tokens(weights, backend, tokenizer):
    """min_tokens bans EOS, the finished grammar allows only EOS: the grammar wins, the
    request ends normally instead of sampling from nothing."""
    core = build_core(weights, backend)
    core.add(request("c", [1, 2, 3], choice("yes", "no"), min_tokens=20, temperature=1.0,
                     seed=1))
    done, tokens = run(core)
    assert done["c"].finish_reason == "stop" and done["c"].error is None
    assert text(tokenizer, tokens["c"]) in ("yes", "no")


def test_logprobs_put_no_mass_on_disallowed_tokens(weights, backend, tokenizer):
    core = build_core(weights, backend)
    core.add(request("c", [1, 2, 3], choice("yes", "no"), logprobs=5))
    so_far: list[int] = []
    for _ in range(40):
        for _, out in core.step():
            ids = np.frombuffer(out.logprobs.top_ids, dtype="<i4")
            lps = np.frombuffer(out.logprobs.top_logprobs, dtype="<f4")
            live = np.isfinite(lps)
            assert live.any() and np.exp(lps[live]).sum() <= 1.0 + 1e-4
            for token in ids[live]:
                if token == EOS:  # allowed once the answer is complete
                    assert tokenizer.decode(so_far) in ("yes", "no")
                    continue
                partial = tokenizer.decode(so_far + [int(token)])
                assert "yes".startswith(partial) or "no".startswith(partial), partial
            so_far += unpack_ids(out.new_token_ids).tolist()
    assert text(tokenizer, so_far) in ("yes", "no")


def test_a_compiling_grammar_does_not_hold_up_other_requests(weights, backend):
    core = build_core(weights, backend)
    gate = threading.Event()
    real = backend._matcher
    backend._matcher = lambda g: (gate.wait(10), real(g))[1]
    try:
        core.add(request("slow", [1, 2, 3], regex("[a-z]{2}")))
        core.add(request("free", [1, 2, 3], max_tokens=4))
        done, _ = run(core, limit=20)
        assert "free" in done and "slow" not in done  # ran to the end while "slow" waited
        assert core.scheduler.waiting[0].request_id == "slow"
    finally:
        gate.set()
        backend._matcher = real
    done, tokens = run(core)
    assert done["slow"].finish_reason == "stop" and len(tokens["slow"]) >= 1


def test_an_invalid_grammar_finishes_its_request_with_a_400(weights, backend):
    core = build_core(weights, backend)
    core.add(request("bad", [1, 2], Constraint("regex", grammar_from("regex", "(a"))))
    core.add(request("free", [1, 2], max_tokens=2))
    done, _ = run(core)
    assert done["bad"].finish_reason == "error" and done["bad"].error_status == 400
    assert "invalid grammar" in done["bad"].error
    assert done["free"].finish_reason == "length"


def test_a_grammar_that_breaks_mid_answer_fails_only_its_request_with_a_400(weights, backend):
    """A matcher that hits one of llguidance's limits at a later mask (forced here) makes
    llguidance allow only EOS: that EOS is not the grammar's, so it is not sent, and the
    request ends with a 400 instead of the old 'rejected sampled token' 500."""
    core = build_core(weights, backend)
    core.add(request("breaks", [1, 2], regex("[a-z]{40}"), max_tokens=50))
    core.add(request("free", [1, 2], max_tokens=8))
    for _ in range(4):
        core.step()
    seq = core.sequences["breaks"]
    sent = seq.num_output_tokens
    assert sent > 0 and not seq.grammar.matcher.consume_token(EOS)  # now in error
    done, tokens = run(core)
    out = done["breaks"]
    assert out.finish_reason == "error" and out.error_status == 400
    assert "the grammar failed after" in out.error and len(tokens.get("breaks", [])) == 0
    assert out.num_output_tokens == sent and EOS not in seq.token_ids[seq.num_prompt_tokens:]
    assert done["free"].finish_reason == "length" and not core.sequences


def test_without_a_backend_constrained_requests_are_refused(weights):
    core = build_core(weights, None)
    core.add(request("c", [1, 2], regex("a")))
    (_, out), = core.step()
    assert out.finish_reason == "error" and "grammar backend" in out.error


def test_abort_frees_the_matcher(weights, backend):
    core = build_core(weights, backend)
    core.add(request("c", [1, 2], regex("[a-z]{40}"), max_tokens=50))
    for _ in range(5):
        core.step()
    seq = core.sequences["c"]
    core.abort(["c"])
    assert seq.grammar is None and not core._compiling and not core.sequences


def test_preemption_keeps_the_matcher_in_step(weights, backend, tokenizer):
    """With pages for only some sequences, recomputation must not replay tokens into the
    matcher: every output still matches."""
    core = build_core(weights, backend, num_pages=12, page_size=4)
    for i in range(4):
        core.add(request(f"r{i}", [1, 2, 3, 4, 5], regex("[a-z]{3}( [a-z]{3}){9}"),
                         temperature=1.0, seed=i, max_tokens=40))
    done, tokens = run(core, limit=2000)
    assert core.num_preemptions > 0
    for i in range(4):
        assert done[f"r{i}"].finish_reason == "stop"
        assert re.fullmatch(r"[a-z]{3}( [a-z]{3}){9}", text(tokenizer, tokens[f"r{i}"]))
