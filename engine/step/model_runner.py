"""Turns a scheduled step into tensors, runs the model, and samples the rows that need it."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import torch

from engine.attention.base import AttentionBackend
from engine.models.llama import LlamaModel
from engine.request.batch import ScheduledChunk
from engine.request.grammar import GrammarMasks, step_masks
from engine.request.records import SampledToken
from engine.step.logits_processors import process_logits
from engine.step.multimodal import step_embeddings
from engine.step.pooler import pool_chunks
from engine.step.sampler import SamplingRows, row_generators, sample, token_logprobs, token_ranks
from engine.step.spec_decode import DraftCheck, verify
from shared.protocol import TokenLogprobs
from shared.runner_config import PoolerConfig

log = logging.getLogger("sluice.engine")


class PromptLogprobs(msgspec.Struct):
    """Logprobs of prompt positions start+1 .. start+len(chosen) (the tokens after each fed
    position), from one prefill chunk."""

    start: int
    chosen: np.ndarray  # float32[k]
    top_ids: np.ndarray  # int32[k, n]
    top_logprobs: np.ndarray  # float32[k, n]
    ranks: np.ndarray  # int32[k]: each prompt token's rank (1: the likeliest)


class StepResult(msgspec.Struct):
    # One per chunk whose `samples` is True, in order; None where that request failed.
    sampled: list[SampledToken | None]
    prompt_logprobs: dict[str, PromptLogprobs]  # by request id
    # Requests whose own part of the step (grammar mask, logits processors, sampling,
    # logprobs) raised, with what failed; the rest of the batch was sampled normally.
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    # By request id: the tokens verifying its draft gave after its sampled one, in order.
    verified: dict[str, list[SampledToken]] = msgspec.field(default_factory=dict)
    # By request id: the pooled vector of each pooling request in the step (engine.step.pooler).
    pooled: dict[str, np.ndarray] = msgspec.field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        vocab_size: int,
        vision=None,
        pooler: PoolerConfig | None = None,
    ) -> None:
        self.model = model
        self.pooler = pooler  # set: a pooling runner (vLLM's --runner pooling)
        # A cross-encoder: its head turns the pooled row into label scores.
        self.classifier = bool(getattr(getattr(model, "options", None), "num_labels", 0))
        # A decoder served as a yes/no reranker (--hf-overrides): engine.step.pooler.TokenScoreHead.
        self.classifier_head = None
        self.backend = backend
        self.vocab_size = vocab_size
        self.vision = vision  # a VLM's encoder (engine.models.idefics3); None: text only
        self.device = model.device
        self.stage = ""  # what the sampling phase ran last (see _sample)
        self.lora_ops = None  # engine.layers.lora_ops.LoraOps when LoRA is enabled

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        """Runs the forward pass (an exception there propagates: the KV cache can no longer
        be trusted) and then each request's own part of the step, where an exception fails
        only the requests that cause it (`StepResult.failed`)."""
        input_ids, positions, sample_rows = self._flatten(chunks)
        if self.lora_ops is not None:  # which rows run under which adapter
            self.lora_ops.set_step([(c.seq.lora_id, c.num_tokens) for c in chunks],
                                   len(input_ids), self.device)
        if getattr(self.model, "bidirectional", False):
            # An encoder (engine.models.bert): whole prompts, no paged KV cache.
            hidden = self.model.encode(input_ids, positions, [c.num_tokens for c in chunks],
                                       _token_types(chunks, self.device))
        else:
            meta = self.backend.prepare(chunks)
            embeds = step_embeddings(chunks, self.vision)  # image tokens' inputs (req T-13)
            hidden = self.model.forward(input_ids, positions, self.backend, meta, embeds)
        seqs = [c.seq for c in chunks if c.samples]
        masks, mask_error = None, None
        try:
            # On the CPU while the device still runs the forward pass.
            masks = step_masks([s.grammar for s in seqs])
        except Exception as exc:  # some grammar broke: found row by row below
            mask_error = exc
        failed: dict[str, str] = {}
        result = StepResult([], self._prompt_logprobs(chunks, hidden, failed), failed)
        if self.pooler is not None:
            result.pooled = self._pool(chunks, hidden, failed)
        if seqs:
            sampling = [c for c in chunks if c.samples]
            checks, draft_rows = _draft_rows(sampling, sample_rows.tolist())
            logits = None
            if checks:
                # One pass over the LM head for the sampled rows and the draft rows.
                rows = torch.cat([sample_rows, torch.tensor(draft_rows, device=self.device)])
                logits = self.model.logits(hidden[rows])
            result.sampled = self._sample_isolated(
                seqs, hidden[sample_rows], masks, mask_error, failed,
                None if logits is None else logits[: len(seqs)])
            if checks:
                result.verified = self._verify(checks, sampling, logits[len(seqs):], result)
        return result

    def _verify(self, checks: list[DraftCheck], sampling: list[ScheduledChunk],
                draft_logits: torch.Tensor, result: StepResult
                ) -> dict[str, list[SampledToken]]:
        """Draft positions, scored in the same forward pass, into the tokens they give
        (engine.step.spec_decode.verify), for the rows whose first token came out."""
        first = dict(zip((c.seq.request_id for c in sampling), result.sampled, strict=True))
        kept = [c for c in checks if first[c.seq.request_id] is not None
                and c.seq.request_id not in result.failed]
        if not kept:
            return {}
        return verify(kept, [first[c.seq.request_id] for c in kept], draft_logits,
                      self._sample)

    def _sample_isolated(self, seqs, hidden: torch.Tensor, masks: GrammarMasks | None,
                         mask_error: Exception | None, failed: dict[str, str],
                         logits: torch.Tensor | None = None) -> list[SampledToken | None]:
        """The batch at once, as always; only if that raises, row by row, so the requests at
        fault fail and the others get the tokens they would have got anyway (a seeded
        row's generator depends only on its seed and position). `logits`: of `hidden`, when
        the caller has them already."""
        if mask_error is None:
            try:
                if logits is None:
                    logits = self.model.logits(hidden)
                return self._sample(seqs, logits, masks)
            except Exception as exc:
                _reraise_device_fault(exc)
                log.warning("batched sampling failed (%s: %s); sampling row by row",
                            type(exc).__name__, exc)
        else:
            _reraise_device_fault(mask_error)
        logits = self.model.logits(hidden)  # afresh: the failed attempt changed them in place
        sampled: list[SampledToken | None] = []
        for i, seq in enumerate(seqs):
            try:
                self.stage = "the grammar mask"
                one_mask = step_masks([seq.grammar])
                sampled.append(self._sample([seq], logits[i : i + 1], one_mask)[0])
            except Exception as exc:
                _reraise_device_fault(exc)
                failed[seq.request_id] = f"{self.stage} failed: {type(exc).__name__}: {exc}"
                log.warning("request %s failed in %s: %s", seq.request_id, self.stage, exc,
                            extra={"request_id": seq.request_id})
                sampled.append(None)
        return sampled

    def _sample(self, seqs, logits: torch.Tensor, masks: GrammarMasks | None = None
                ) -> list[SampledToken]:
        # `stage` names what ran last, for the error of a request that breaks it.
        self.stage = "the logits processors"
        process_logits(logits, seqs)
        if masks is not None:
            # Last, so nothing re-enables a token the grammar forbids; logprobs see it (O-4).
            self.stage = "the grammar mask"
            masks.apply(logits)
        self.stage = "sampling"
        params = [s.params for s in seqs]
        rows = SamplingRows.build(params, row_generators(seqs), self.vocab_size)
        tokens = sample(logits, rows)
        self.stage = "logprobs"
        sampled = [SampledToken(t) for t in tokens.tolist()]
        wanting = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanting:
            num_top = max(params[i].logprobs for i in wanting)
            chosen, top_ids, top_lps = token_logprobs(logits[wanting], tokens[wanting], num_top)
            for r, i in enumerate(wanting):
                n = params[i].logprobs
                sampled[i].logprob = float(chosen[r])
                sampled[i].logprobs = TokenLogprobs(
                    chosen[r : r + 1].cpu().numpy().astype("<f4").tobytes(),
                    top_ids[r, :n].cpu().numpy().astype("<i4").tobytes(),
                    top_lps[r, :n].cpu().numpy().astype("<f4").tobytes(),
                )
        return sampled

    def _pool(self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
              failed: dict[str, str]) -> dict[str, np.ndarray]:
        if not any(c.seq.pooling is not None for c in chunks):
            return {}
        try:
            head = self.classifier_head or (getattr(self.model, "classify", None)
                                            if self.classifier else None)
            return pool_chunks(self.model.final_hidden(hidden), chunks, self.pooler, head)
        except Exception as exc:  # every pooling request of the step fails, nothing else
            _reraise_device_fault(exc)
            for chunk in chunks:
                if chunk.seq.pooling is not None:
                    failed[chunk.seq.request_id] = f"pooling failed: {type(exc).__name__}: {exc}"
            return {}

    def _prompt_logprobs(self, chunks, hidden: torch.Tensor, failed: dict[str, str]
                         ) -> dict[str, PromptLogprobs]:
        out, row = {}, 0
        for chunk in chunks:
            seq, rows = chunk.seq, slice(row, row + chunk.num_tokens)
            row += chunk.num_tokens
            n = seq.params.prompt_logprobs
            # Each fed prompt position predicts the next prompt token, if there is one.
            last = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
            if n is None or seq.num_output_tokens > 0 or last <= chunk.start:
                continue
            try:
                out[seq.request_id] = self._chunk_prompt_logprobs(chunk, hidden[rows], last, n)
            except Exception as exc:  # this request's own work: it fails, the step goes on
                _reraise_device_fault(exc)
                failed[seq.request_id] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
        return out

    def _chunk_prompt_logprobs(self, chunk: ScheduledChunk, hidden: torch.Tensor, last: int,
                               n: int) -> PromptLogprobs:
        seq = chunk.seq
        logits = self.model.logits(hidden[: last - chunk.start])
        targets = torch.tensor(seq.token_ids[chunk.start + 1 : last + 1], device=self.device)
        chosen, top_ids, top_lps = (t.cpu().numpy() for t in token_logprobs(logits, targets, n))
        ranks = token_ranks(logits, targets).cpu().numpy().astype(np.int32)
        return PromptLogprobs(chunk.start, chosen, top_ids.astype(np.int32), top_lps, ranks)

    def _flatten(self, chunks: list[ScheduledChunk]):
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            known = end - len(chunk.draft)
            ids.extend(chunk.seq.token_ids[chunk.start : known])
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
            ids.extend(chunk.draft)  # its rows follow the sampled one (verified there)
            positions.extend(range(chunk.start, end))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), as_tensor(sample_rows)


def _token_types(chunks: list[ScheduledChunk], device) -> torch.Tensor:
    """Each fed token's segment (0 unless a pooling request says otherwise)."""
    parts = [np.frombuffer(c.seq.pooling.token_type_ids, dtype="<i4")
             if c.seq.pooling is not None and c.seq.pooling.token_type_ids
             else np.zeros(c.num_tokens, dtype="<i4") for c in chunks]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)


def _draft_rows(sampling: list[ScheduledChunk], sample_rows: list[int]
                ) -> tuple[list[DraftCheck], list[int]]:
    """A check per drafting chunk, and the rows of every draft token in the step: a draft
    follows its chunk's sampled row, and its check's `row` indexes this list."""
    checks, rows = [], []
    for chunk, row in zip(sampling, sample_rows, strict=True):
        if chunk.draft:
            checks.append(DraftCheck(chunk.seq, chunk.draft, len(rows)))
            rows.extend(range(row + 1, row + 1 + len(chunk.draft)))
    return checks, rows


def _reraise_device_fault(exc: Exception) -> None:
    """A device fault is no request's fault and poisons every later kernel: let it take the
    engine down (to be restarted) instead of failing requests one by one."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA error" in str(exc):
        raise exc
