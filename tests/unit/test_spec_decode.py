"""Speculative decoding (engine.step.spec_decode, --speculative-config): the flag's bounds, the
n-gram proposer, and in the engine that drafting changes nothing but the step count: greedy
tokens, finishes, logprobs, penalties and grammars as without it, sampled tokens with the
same distribution, no KV page left behind and no draft page in the prefix cache."""

import argparse
import json
from collections import Counter

import msgspec
import pytest
import torch
from llguidance import grammar_from

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.llama import LlamaModel
from engine.request.batch import ScheduledChunk
from engine.request.grammar import GrammarBackend
from engine.step.core import EngineCore
from engine.step.kv_cache import PageAllocator
from engine.step.model_runner import ModelRunner
from engine.step.scheduler import Scheduler
from engine.step.spec_decode import Drafter, NgramProposer
from shared import histograms as h
from shared.metrics_export import engine_families, with_vllm_names
from shared.model_source import default_model_path
from shared.protocol import Constraint, unpack_ids
from shared.speculative import SpeculativeConfigError, parse_speculative_config
from shared.tokenizer import load_tokenizer
from sluice import cli
from tests.unit.engine_builders import (
    SMOLLM2_EOS,
    SMOLLM2_VOCAB_CONFIG,
    VOCAB,
    assert_all_free,
    build_core,
    prompts,
    random_weights,
    request,
    run,
    smollm2_vocab_weights,
)


def spec(k=4, low=1, high=3, batch=64):
    return parse_speculative_config(json.dumps({
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
        "prompt_lookup_max": high, "disable_by_batch_size": batch}))


@pytest.fixture(scope="module")
def weights():
    return random_weights()


# ---------------------------------------------------------------- the flag


@pytest.mark.parametrize("text, message", [
    ("{bad", "not a valid config"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "unknown method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must lie"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens must lie"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens must lie"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min (4) is above prompt_lookup_max (2)"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}',
     "prompt_lookup_max must lie"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 99}',
     "prompt_lookup_max must lie"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}',
     "disable_by_batch_size must be"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}', "unknown field `typo`"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "some/draft"}',
     "draft models"),
    ('[1, 2]', "not a valid config"),
])
def test_bad_configs_stop_the_process_naming_the_flag(text, message, capsys):
    with pytest.raises(SpeculativeConfigError, match="--speculative-config") as err:
        parse_speculative_config(text)
    assert message in str(err.value)
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--speculative-config", text])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


def test_lookup_bounds_default_as_in_vllm():
    one = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_max": 4}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    none = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (none.prompt_lookup_min, none.prompt_lookup_max) == (5, 5)
    assert none.disable_by_batch_size >= 1


def test_serve_passes_the_config_to_its_engine(monkeypatch):
    """`sluice serve` starts `sluice engine` with the same config; without the flag the
    engine has none (speculation is off by default)."""
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    args = cli.parse_args(["serve", "--speculative-config", text])
    assert cli.engine_config(args, "ipc:///tmp/x").speculative == parse_speculative_config(text)
    plain = cli.parse_args(["serve"])
    assert cli.engine_config(plain, "ipc:///tmp/x").speculative is None
    engine_args = cli.parse_args(["engine", "--speculative-config", msgspec.json.encode(
        args.speculative_config).decode()])
    assert engine_args.speculative_config == args.speculative_config
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)


# ---------------------------------------------------------------- the proposer


def test_ngram_proposer_takes_the_longest_latest_match():
    p = NgramProposer(num_tokens=3, lookup_min=1, lookup_max=3)
    # Suffix [7, 8]: its longest earlier match is [6, 7, 8] at 0..2 (3 tokens); a
    # later [7, 8] at 5..6 matches only 2 tokens.
    assert p.propose([6, 7, 8, 1, 2, 7, 8, 3, 6, 7, 8], limit=8) == [1, 2, 7]
    assert p.propose([6, 7, 8, 1, 2, 7, 8, 3, 6, 7, 8], limit=2) == [1, 2]
    # Among equally long matches, the latest.
    assert p.propose([5, 1, 5, 2, 5], limit=1) == [2]
    assert p.propose([1, 2, 3, 4], limit=4) == []  # the last token never occurred before
    strict = NgramProposer(num_tokens=3, lookup_min=2, lookup_max=3)
    assert strict.propose([9, 5, 1, 5], limit=3) == []  # only a 1-token match
    assert strict.propose([9, 5, 1, 9, 5], limit=3) == [1, 9, 5]
    assert p.propose([4, 4], limit=0) == []


# ---------------------------------------------------------------- in the engine


class OracleProposer:
    """Drafts the known greedy continuation of the reference runs, wrong at every third
    position, so drafts are accepted in full, in part and not at all."""

    def __init__(self, references: list[list[int]], num_tokens: int = 4) -> None:
        self.references = references
        self.num_tokens = num_tokens

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        for ref in self.references:
            if ref[: len(tokens)] == tokens:
                draft = ref[len(tokens) : len(tokens) + min(limit, self.num_tokens)]
                if len(tokens) % 3 == 0 and draft:
                    draft[-1] = (draft[-1] + 1) % VOCAB
                return draft
        return []


def counts(core) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) the engine verified."""
    hists = core.stats().histograms
    drafted, accepted = hists[h.SPEC_DRAFT_TOKENS], hists[h.SPEC_ACCEPTED_TOKENS]
    return sum(drafted.counts), int(drafted.total), int(accepted.total)


def both(weights, requests, config=None, proposer=None, **core_kwargs):
    """Results without and with speculation, and the speculating core."""
    plain, _ = build_core(weights, **core_kwargs)
    expected = run(plain, requests())
    core, _ = build_core(weights, speculative=config or spec(), **core_kwargs)
    if proposer is not None:
        core.scheduler.drafter.proposer = proposer(expected)
    return expected, run(core, requests()), core, plain


def oracle(prompt_list, **kwargs):
    def make(expected):
        refs = [p + r.tokens for p, r in zip(prompt_list, expected.values(), strict=True)]
        return OracleProposer(refs, **kwargs)
    return make


@pytest.mark.parametrize("lengths", [[7], [3, 9, 17, 30, 5]])
def test_greedy_tokens_equal_plain_decoding(weights, lengths):
    ps = prompts(lengths, seed=3)
    requests = lambda: [request(f"r{i}", p, max_tokens=40) for i, p in enumerate(ps)]  # noqa: E731
    expected, got, core, plain = both(weights, requests)
    assert got == expected
    drafts, drafted, accepted = counts(core)
    assert drafts > 0 and accepted > 0  # the n-gram drafts did run
    assert core.num_steps < plain.num_steps or len(lengths) > 1


def test_partly_wrong_drafts_keep_greedy_tokens_and_return_pages(weights):
    ps = prompts([6, 11, 4], seed=5)
    requests = lambda: [request(f"r{i}", p, max_tokens=30) for i, p in enumerate(ps)]  # noqa: E731
    # Pages of 4 tokens and few of them: drafts cross page ends, and pages run short.
    expected, got, core, plain = both(weights, requests, proposer=oracle(ps), page_size=4,
                                      num_pages=40)
    assert got == expected
    drafts, drafted, accepted = counts(core)
    assert 0 < accepted < drafted  # some accepted, some rejected
    assert core.num_steps < plain.num_steps
    assert_all_free(core)
    # What the prefix cache holds is the same: no page of a rejected draft got in.
    assert set(core.allocator._page_of) == set(plain.allocator._page_of)


def test_stops_inside_a_draft_end_the_answer_where_plain_decoding_does(weights):
    ps = prompts([5, 8], seed=7)
    base, _ = build_core(weights)
    free = run(base, [request(f"r{i}", p, max_tokens=30) for i, p in enumerate(ps)])
    stop_id = free["r0"].tokens[9]  # a token the answer reaches mid-way
    eos = free["r1"].tokens[12]

    def requests():
        return [request("ids", ps[0], max_tokens=30, stop_token_ids=[stop_id]),
                request("eos", ps[1], max_tokens=30),
                request("min", ps[1], max_tokens=30, min_tokens=14),
                request("length", ps[0], max_tokens=7),
                request("ignore", ps[1], max_tokens=20, ignore_eos=True)]
    refs = [ps[0] + free["r0"].tokens, ps[1] + free["r1"].tokens]
    expected, got, core, _ = both(
        weights, requests, eos=(eos,),
        proposer=lambda _: OracleProposer(refs))
    assert got == expected
    assert expected["ids"].stop_reason == stop_id
    assert expected["eos"].finish_reason == "stop"
    assert counts(core)[2] > 0


def test_penalties_and_bias_see_the_accepted_draft_tokens(weights):
    ps = prompts([6, 9], seed=11)

    def requests():
        return [request("rep", ps[0], max_tokens=24, repetition_penalty=1.3),
                request("freq", ps[1], max_tokens=24, frequency_penalty=0.6,
                        presence_penalty=0.3),
                request("bias", ps[0], max_tokens=24, logit_bias=[(5, 3.0)])]
    expected, got, core, _ = both(weights, requests, proposer=oracle([ps[0], ps[1], ps[0]]))
    assert got == expected
    assert counts(core)[2] > 0


def test_logprobs_of_verified_tokens_match_plain_decoding(weights):
    ps = prompts([8], seed=13)

    def outputs(config):
        core, _ = build_core(weights, speculative=config)
        if config is not None:
            core.scheduler.drafter.proposer = OracleProposer([ps[0] + tokens])
        core.add(request("lp", ps[0], max_tokens=20, logprobs=3))
        out = []
        while core.has_work:
            out.extend(o for _, o in core.step())
        assert_all_free(core)
        return out, core

    plain, _ = outputs(None)
    tokens = [t for o in plain for t in unpack_ids(o.new_token_ids).tolist()]
    drafted, core = outputs(spec())
    assert counts(core)[2] > 0
    # One output per token, as without drafts.
    assert [unpack_ids(o.new_token_ids).tolist() for o in drafted] == [[t] for t in tokens]
    for a, b in zip(plain, drafted, strict=True):
        for field in ("token_logprobs", "top_logprobs"):
            x = torch.frombuffer(bytearray(getattr(a.logprobs, field)), dtype=torch.float32)
            y = torch.frombuffer(bytearray(getattr(b.logprobs, field)), dtype=torch.float32)
            assert torch.allclose(x, y, atol=1e-4)
        assert a.logprobs.top_ids == b.logprobs.top_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_no_drafts_in_a_batch_bigger_than_disable_by_batch_size(weights):
    ps = prompts([5, 6, 7], seed=3)
    core, _ = build_core(weights, speculative=spec(batch=2))
    run(core, [request(f"r{i}", p, max_tokens=30) for i, p in enumerate(ps)])
    assert counts(core)[0] == 0
    alone, _ = build_core(weights, speculative=spec(batch=2))
    run(alone, [request("r", ps[0], max_tokens=30)])
    assert counts(alone)[0] > 0


def test_a_sequence_whose_drafts_fail_stops_drafting(weights):
    class Wrong:
        def propose(self, tokens, limit):
            return [(tokens[-1] + 1) % VOCAB, 0, 0][:limit]

    core, _ = build_core(weights, speculative=spec())
    core.scheduler.drafter.proposer = Wrong()
    run(core, [request("r", prompts([5])[0], max_tokens=60)])
    drafts, _, accepted = counts(core)
    assert accepted == 0
    assert drafts < 20  # paused after a few failures, probing now and then, not every step


def test_seeded_sampling_keeps_its_distribution(weights):
    """Sampled rows accept a draft token with its probability, else draw from the rest: over
    600 seeds the tokens' distribution (the 4 likeliest tokens of each position and the
    rest) and the frequency of the drafted path equal plain decoding's, within what 600
    draws allow (fixed seeds: the check is deterministic). A sampler that took every draft
    token fails both."""
    prompt = prompts([6], seed=17)[0]
    n, temperature = 600, 0.3
    greedy_core, _ = build_core(weights)
    greedy = run(greedy_core, [request("g", prompt, max_tokens=3)])["g"].tokens

    def sample(config, seeds):
        core, _ = build_core(weights, speculative=config, max_num_seqs=n, budget=4096,
                             num_pages=4096)
        if config is not None:
            core.scheduler.drafter.proposer = OracleProposer([prompt + greedy], num_tokens=2)
        results = run(core, [request(f"s{s}", prompt, max_tokens=3, temperature=temperature,
                                     seed=s) for s in seeds])
        return [tuple(r.tokens) for r in results.values()], core

    plain, _ = sample(None, range(10_000, 10_000 + n))
    drafted, core = sample(spec(batch=10_000), range(n))
    assert counts(core)[2] > 0

    def tv(a, b):
        ca, cb = Counter(a), Counter(b)
        return 0.5 * sum(abs(ca[k] - cb[k]) for k in ca | cb) / n

    def coarse(runs, pos, top):
        return [t[pos] if t[pos] in top else -1 for t in runs]

    def path(runs):  # how often the drafted (greedy) path came out
        return sum(t[:2] == tuple(greedy[:2]) for t in runs) / n

    for pos in range(3):
        top = {t for t, _ in Counter(t[pos] for t in plain).most_common(4)}
        assert tv(coarse(plain, pos, top), coarse(drafted, pos, top)) < 0.1
    assert abs(path(plain) - path(drafted)) < 0.04
    # The same checks see a sampler that took every draft token.
    always = [(t[0], greedy[1], t[2]) if t[0] == greedy[0] else t for t in plain]
    assert abs(path(plain) - path(always)) > 0.04
    # And seeded requests repeat.
    again, _ = sample(spec(batch=10_000), range(20))
    assert again == drafted[:20]


def test_metrics_carry_vllms_spec_decode_series(weights):
    core, _ = build_core(weights, speculative=spec())
    run(core, [request("r", prompts([7], seed=3)[0], max_tokens=40)])
    drafts, drafted, accepted = counts(core)
    samples = {(s.name, s.labels.get("position")): s.value
               for family in with_vllm_names(engine_families(core.stats()))
               for s in family.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == drafted
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == accepted
    per_pos = [v for (name, pos), v in samples.items()
               if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert samples[("sluice:spec_decode_acceptance_length_count", None)] == drafts
    plain, _ = build_core(weights)
    assert not any("spec_decode" in f.name for f in engine_families(plain.stats()))


# ---------------------------------------------------------------- grammars

EOS = SMOLLM2_EOS
BIG = SMOLLM2_VOCAB_CONFIG


@pytest.fixture(scope="module")
def grammar_backend():
    return GrammarBackend(load_tokenizer(default_model_path()), BIG.vocab_size, [EOS],
                          mask_threads=1)


def grammar_core(backend, config):
    model = LlamaModel(BIG, smollm2_vocab_weights(), 256, torch.float32, torch.device("cpu"))
    attn = TorchAttentionBackend(1, 256, 4, 1, 16, torch.float32, torch.device("cpu"))
    allocator = PageAllocator(256, 4)
    drafter = Drafter(config) if config is not None else None
    return EngineCore(
        ModelRunner(model, attn, BIG.vocab_size), allocator,
        Scheduler(allocator, 512, 32, drafter=drafter), eos_token_ids=[EOS], max_model_len=256,
        vocab_size=BIG.vocab_size, engine_id="t", model_name="tiny", grammar=backend)


def test_json_schema_answers_are_the_same_with_drafts(grammar_backend):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "tags": {"type": "array", "items": {"enum": ["aa", "bb"]}, "maxItems": 4}},
              "required": ["name", "tags"], "additionalProperties": False}
    constraint = Constraint("json_schema", grammar_from("json_schema", json.dumps(schema)))
    prompt = [1, 2, 3, 4]

    def answers(config, references=None):
        core = grammar_core(grammar_backend, config)
        if references is not None:
            core.scheduler.drafter.proposer = OracleProposer(references)
        for i, extra in enumerate(({}, {"logprobs": 2})):
            core.add(request(f"j{i}", prompt, constraint=constraint, max_tokens=40,
                             temperature=0.0, **extra))
        tokens = {}
        while core.has_work:
            for _, out in core.step():
                tokens.setdefault(out.request_id, []).extend(
                    unpack_ids(out.new_token_ids).tolist())
        assert_all_free(core)
        return tokens, core

    expected, _ = answers(None)
    got, core = answers(spec(), [prompt + t for t in expected.values()])
    assert got == expected
    assert counts(core)[2] > 0


def test_a_verifying_chunk_is_attended_as_decode_rows(weights):
    """Each draft position is a decode row with its own context (the decode kernel, the
    numbers plain decoding gets), not a masked prefill over the gathered context."""
    core, _ = build_core(weights)
    core.add(request("r", prompts([9])[0], max_tokens=8))
    core.step()
    seq = core.sequences["r"]
    core.scheduler._try_grow(seq, 4)
    chunk = ScheduledChunk(seq, seq.num_computed, 4, [1, 2, 3])
    meta = core.runner.backend.prepare([chunk])
    assert not meta.prefills and meta.decode_rows.tolist() == [0, 1, 2, 3]
    start = seq.num_computed
    keys = meta.decode_mask.sum(-1).flatten().tolist()  # the plain torch path: a key mask
    assert keys == [start + 1, start + 2, start + 3, start + 4]


def test_draft_length_follows_the_acceptance_rate_and_the_batch():
    from engine.request.records import DraftState
    from engine.request.sequence import Sequence
    from shared.protocol import SamplingParams

    drafter = Drafter(spec(k=6, low=1, high=2))
    seq = Sequence(request_id="s", token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 1], num_prompt_tokens=9,
                   params=SamplingParams(max_tokens=20), reply_to="inproc://x",
                   arrival_time=0.0, max_output_tokens=20)
    assert drafter.propose(seq, 10) == [2, 3, 4, 5, 6, 7]  # no record yet: k tokens
    seq.draft_state = DraftState(rate=0.5)
    assert drafter.propose(seq, 10) == [2]  # about one accepted token expected
    assert drafter.propose(seq, 10, batched=True) == []  # beside others: not worth a row
    seq.draft_state = DraftState(rate=0.8)
    assert drafter.propose(seq, 10, batched=True) == [2, 3, 4, 5]
    assert drafter.room(num_running=3, num_waiting=0) == 18  # no step bound here
    bounded = Drafter(spec(batch=8), step_tokens=4)
    assert [bounded.room(n, 0) for n in (1, 3, 4, 6)] == [3, 1, 0, 0]
    assert bounded.room(2, 7) == 0  # more than disable_by_batch_size in the engine


def test_drafts_take_no_page_another_sequence_needs(weights):
    """One page left, two decoding sequences: the first one's draft would take it and the
    second, whose next token starts a page, would be preempted; the draft gives way."""
    core, _ = build_core(weights, num_pages=5, page_size=4, speculative=spec())
    a, b = prompts([6, 8], seed=21)

    class DraftForA:
        def propose(self, tokens, limit):
            return [1, 2] if tokens[:6] == a else []

    core.scheduler.drafter.proposer = DraftForA()
    core.add(request("a", a, max_tokens=20))
    core.add(request("b", b, max_tokens=20))
    core.step()  # both prefilled: 2 pages each, one left
    assert core.allocator.num_free == 1
    plan = core.scheduler.schedule()
    assert not plan.preempted
    assert [(c.seq.request_id, c.draft) for c in plan.chunks] == [("a", []), ("b", [])]
