"""The engine's state machine without sockets: add, abort, step, stats.

`engine.process.server` feeds it from the network; tests can drive it directly.
"""

from __future__ import annotations

import logging
import time

from engine.request.grammar import GrammarBackend
from engine.request.sequence import Sequence
from engine.step.engine_stats import engine_stats, observe_times
from engine.step.kv_cache import PageAllocator
from engine.step.lora_adapters import LoraError, LoraManager
from engine.step.model_runner import ModelRunner
from engine.step.multimodal import ImageProblem, parse_images
from engine.step.request_checks import continuation_problem, request_problem, resumed_ids
from engine.step.request_output import output_for
from engine.step.scheduler import Scheduler
from engine.step.tracing import engine_traces, note_chunk
from shared import histograms as h
from shared.param_ranges import MAX_LOGPROBS
from shared.protocol import (
    EngineRequest,
    EngineStats,
    LoraAdapterInfo,
    LoraUpdate,
    LoraUpdateResult,
    RequestOutput,
    unpack_ids,
)
from shared.runner_config import PoolingFacts

log = logging.getLogger("sluice.engine")


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        allocator: PageAllocator,
        scheduler: Scheduler,
        *,
        eos_token_ids: list[int],
        max_model_len: int,
        vocab_size: int,
        engine_id: str,
        model_name: str,
        grammar: GrammarBackend | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        pooling: PoolingFacts | None = None,
        hidden_size: int = 0,
        lora: LoraManager | None = None,
        tokenizer_fingerprint: str = "",
    ) -> None:
        self.runner = runner
        self.allocator = allocator
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs  # --max-logprobs (-1: the vocabulary)
        self.engine_id = engine_id
        self.model_name = model_name
        self.tokenizer_fingerprint = tokenizer_fingerprint  # reported with the stats
        self.sequences: dict[str, Sequence] = {}
        # Set: a pooling engine (vLLM's --runner pooling), which takes pooling requests only.
        self.pooling = pooling
        self.hidden_size = hidden_size  # the pooled vector's size, before any Matryoshka cut
        options = getattr(getattr(runner, "model", None), "options", None)
        self.type_vocab_size = getattr(options, "type_vocab_size", 1)  # encoders' segments
        self.lora = lora  # its LoRA adapters (--enable-lora); None: base model only
        # What a VLM takes as an image (engine.step.multimodal); None: text only, images refused.
        vision = getattr(runner, "vision", None)
        self.image_spec = vision.spec if vision is not None else None
        # Structured output (llguidance); None: constrained requests are refused.
        self.grammar = grammar
        self._compiling: dict[str, Sequence] = {}  # requests whose grammar is not ready yet
        # Outputs produced outside a step (rejections, aborts), sent with the next batch.
        self._pending: list[tuple[str, RequestOutput]] = []
        self.traces = engine_traces(engine_id, model_name)  # None: this engine traces nothing
        self._start_counts()

    def _start_counts(self) -> None:
        """The counts the engine's stats and /metrics report, all from zero."""
        self.num_steps = 0
        self.max_seqs_in_step = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0  # requests whose own part of a step raised
        self.num_preemptions = 0
        self.num_computed_tokens = 0
        self.step_time_total_s = 0.0
        # vLLM's engine histograms (tokens per step, per-request phase times) as counts.
        self.histograms = h.engine_histograms()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    # ---------------------------------------------------------------- requests in

    def add(self, request: EngineRequest, peer: bytes | None = None) -> None:
        """`peer`: the connection it came on, so a frontend that goes silent can have its
        requests aborted (`abort_peer`)."""
        try:
            self._admit(request, peer)
        except Exception as exc:  # nothing was added yet: only this request is lost
            log.exception("could not admit request %s", request.request_id[:200],
                          extra={"request_id": request.request_id[:200]})
            self._reject(request, 0, f"the engine could not admit this request: {exc}", 500)

    def _admit(self, request: EngineRequest, peer: bytes | None) -> None:
        if len(request.prompt_token_ids) % 4:
            self._reject(request, 0, "prompt_token_ids must be a buffer of int32 values")
            return
        prompt = unpack_ids(request.prompt_token_ids).tolist()
        resumed = resumed_ids(request)
        problem = request_problem(self, request, prompt) or continuation_problem(
            self, request, prompt, resumed)
        if problem is not None:
            self._reject(request, len(prompt), problem)
            return
        try:
            images = parse_images(request.images, prompt, self.image_spec)
        except ImageProblem as exc:
            self._reject(request, len(prompt), str(exc))
            return
        seq = self._new_sequence(request, prompt, resumed, images, peer)
        if request.lora_name is not None:
            try:
                seq.lora_id = self._acquire_lora(request.lora_name)
                seq.lora_name = request.lora_name
            except LoraError as exc:
                self._reject(request, len(prompt), str(exc), exc.status)
                return
        if request.params.constraint is not None:
            try:
                seq.grammar = self.grammar.compile(request.params.constraint)
            except Exception:
                self._release_lora(seq)
                raise
            self._compiling[seq.request_id] = seq
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(self, request: EngineRequest, prompt: list[int],
                      resumed: list[int] | None, images, peer: bytes | None) -> Sequence:
        """The engine's state for an admitted request."""
        params = request.params
        seq = Sequence(
            request_id=request.request_id,
            token_ids=prompt + (resumed or []),
            num_prompt_tokens=len(prompt),
            params=params,
            reply_to=request.reply_to,
            arrival_time=request.arrival_time,
            queued_time=time.time(),
            max_output_tokens=min(params.max_tokens, self.max_model_len - len(prompt)),
            min_tokens_banned=self._min_tokens_banned(params),
            cache_salt=request.cache_salt,
            priority=request.priority,
            priority_tier=request.priority_tier,
            peer=peer,
            images=images,
            pooling=request.pooling,
        )
        if resumed:
            # A continuation: its earlier tokens were reported by the engine that drew them.
            seq.num_reported = len(resumed)
            seq.cumulative_logprob = request.continuation.cumulative_logprob
        if self.traces is not None and request.trace_context is not None:
            self.traces.start(seq, request)
        return seq

    def _acquire_lora(self, name: str) -> int:
        if self.lora is None:
            raise LoraError(f"The model '{name}' does not exist (LoRA is not enabled).", 404)
        return self.lora.acquire(name)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_id and self.lora is not None:
            self.lora.release(seq.lora_id)
            seq.lora_id = 0

    def update_lora(self, update: LoraUpdate) -> LoraUpdateResult:
        """Load or unload an adapter at run time; the answer names any problem (an adapter
        never takes the engine down)."""
        try:
            if self.lora is None:
                raise LoraError("LoRA is not enabled on this engine (--enable-lora)")
            if update.action == "load":
                self.lora.load(LoraAdapterInfo(update.name, update.path))
            elif update.action == "unload":
                self.lora.unload(update.name)
            else:
                raise LoraError(f"unknown LoRA action {update.action!r}")
        except LoraError as exc:
            return LoraUpdateResult(update.op_id, exc.status, str(exc))
        except Exception as exc:  # whatever else reading it raised: the update's fault
            log.exception("LoRA %s of %r failed", update.action, update.name[:200])
            return LoraUpdateResult(update.op_id, 400, f"{type(exc).__name__}: {exc}")
        return LoraUpdateResult(update.op_id, 200, "")

    def _min_tokens_banned(self, params) -> list[int]:
        if params.min_tokens == 0:
            return []
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= self.eos_token_ids
        return sorted(banned)

    def _reject(self, request: EngineRequest, num_prompt: int, message: str,
                status: int = 400) -> None:
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=b"",
            num_prompt_tokens=num_prompt,
            num_output_tokens=0,
            finish_reason="error",
            error=message,
            error_status=status,
        )
        self._pending.append((request.reply_to, output))
        if self.traces is not None and request.trace_context is not None:
            self.traces.rejected(request, message, status)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            if seq is None:
                continue  # already finished: nothing to free
            self.scheduler.finish(seq)
            self._drop_grammar(seq)
            self._release_lora(seq)
            seq.finish_reason = "abort"
            self.num_aborted += 1
            observe_times(self.histograms, seq)
            if seq.trace is not None:
                self.traces.finished(seq)
            self._pending.append((seq.reply_to, output_for(seq)))

    def abort_peer(self, peer: bytes) -> list[str]:
        """Aborts every request that came on a connection gone silent (its frontend died or
        froze: nobody reads the answers). Returns the result addresses no request uses now."""
        gone = [s for s in self.sequences.values() if s.peer == peer]
        if gone:
            log.warning("a frontend stopped heartbeating; aborting its %d requests", len(gone))
        self.abort([s.request_id for s in gone])
        in_use = {s.reply_to for s in self.sequences.values()}
        return sorted({s.reply_to for s in gone} - in_use)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[tuple[str, RequestOutput]]:
        """Run one model step; returns (reply_to, output) for every request with news."""
        started = time.perf_counter()
        self._poll_grammars()
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self._compiling:
                # Only grammars are left to wait for: sleep on them rather than spin.
                GrammarBackend.wait_any([s.grammar for s in self._compiling.values()], 0.01)
            return outputs
        scheduled_at = time.time()
        for chunk in plan.chunks:
            if chunk.seq.scheduled_time is None:
                chunk.seq.scheduled_time = scheduled_at
        if self.traces is not None:
            self._stamp_traces(plan, scheduled_at)
        result = self.runner.execute(plan.chunks)
        self.num_steps += 1
        self.histograms[h.ITERATION_TOKENS].observe(plan.num_tokens)
        self.num_preemptions += len(plan.preempted)
        self.num_computed_tokens += plan.num_tokens
        self.max_seqs_in_step = max(self.max_seqs_in_step, len(plan.chunks))
        now = time.time()
        sampled = iter(result.sampled)
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens - len(chunk.draft)
            self.scheduler.computed(seq)
            token = next(sampled) if chunk.samples else None
            problem = result.failed.get(seq.request_id)
            if problem is None:
                try:
                    if seq.pooling is not None:
                        self._take_pooled(seq, result, now, outputs)
                        continue
                    self._take_step_result(seq, result, token, now, outputs)
                    if chunk.draft:
                        self._take_verified(chunk, result.verified.get(seq.request_id, []),
                                            now, outputs)
                    continue
                except Exception as exc:  # its own bookkeeping (grammar, stops) broke
                    log.exception("request %s failed after sampling", seq.request_id,
                                  extra={"request_id": seq.request_id})
                    problem = f"processing its token failed: {type(exc).__name__}: {exc}"
            self._fail_in_step(seq, problem, outputs)
        self.step_time_total_s += time.perf_counter() - started
        return outputs

    @staticmethod
    def _stamp_traces(plan, now: float) -> None:
        """Traced requests count their prefill chunks and note when they were preempted."""
        for chunk in plan.chunks:
            if chunk.seq.trace is not None:
                note_chunk(chunk.seq)
        for seq in plan.preempted:
            if seq.trace is not None:
                seq.trace.preempted_at.append(now)

    def _take_step_result(self, seq: Sequence, result, token, now: float, outputs) -> None:
        part = result.prompt_logprobs.get(seq.request_id)
        if part is not None:
            seq.prompt_logprob_parts[part.start] = part
        if token is None:
            return  # a prefill chunk short of the prompt's end
        self._take_token(seq, token, now, outputs)

    def _take_pooled(self, seq: Sequence, result, now: float, outputs) -> None:
        """A pooling request is done after its one prefill: its vector goes out and its
        pages go back (none of them entered the prefix cache)."""
        seq.pooled = result.pooled[seq.request_id]
        seq.first_token_time = seq.last_token_time = now
        seq.finish_reason = "stop"
        outputs.append((seq.reply_to, output_for(seq)))
        self._retire(seq)

    def _take_verified(self, chunk, tokens: list, now: float, outputs) -> None:
        """The tokens verifying a draft gave after the first: each one's draft token before
        it was accepted, so its K/V is in the cache. They go one by one through the path of
        any sampled token, and a finish on the way drops the rest."""
        seq = chunk.seq
        self.scheduler.drafter.record(seq, len(chunk.draft), len(tokens))
        for token in tokens:
            if seq.finish_reason is not None:
                return
            seq.num_computed += 1
            self._take_token(seq, token, now, outputs)
        if seq.finish_reason is None:
            self.scheduler.computed(seq)
            self.scheduler.drop_unused_pages(seq)

    def _take_token(self, seq: Sequence, token, now: float, outputs) -> None:
        seq.token_ids.append(token.token)
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if seq.grammar is not None:
            self._advance_grammar(seq, token.token)
        if seq.finish_reason is None:
            self._check_stop(seq, token.token)
        outputs.append((seq.reply_to, output_for(seq, token.logprobs)))
        if seq.finish_reason is not None:
            self._retire(seq)

    def _fail_in_step(self, seq: Sequence, problem: str, outputs) -> None:
        """Ends one request whose part of the step raised (our fault: 500); its pages go
        back and the rest of the batch carries on."""
        self.num_failed += 1
        seq.finish_reason, seq.error_status = "error", 500
        seq.error = f"the engine could not process this request: {problem}"
        outputs.append((seq.reply_to, output_for(seq)))
        if seq.request_id in self.sequences:
            self._retire(seq)

    # ---------------------------------------------------------------- grammars

    def _poll_grammars(self) -> None:
        """Requests whose grammar finished compiling may run; a grammar that failed to compile
        ends its request with a 400 (the frontend validates, but the engine has the last word)."""
        for request_id, seq in list(self._compiling.items()):
            if not seq.grammar.compiled:
                continue
            del self._compiling[request_id]
            problem = seq.grammar.poll()
            if problem is None and not all(seq.grammar.advance(t) for t in seq.output_ids):
                # A continuation's grammar catches up with the tokens drawn elsewhere.
                problem = "the continued tokens do not follow it"
            if problem is not None:
                self._fail(seq, f"invalid grammar: {problem}", 400)

    def _advance_grammar(self, seq: Sequence, token: int) -> None:
        if seq.grammar.failed or not seq.grammar.advance(token):
            # The client's grammar broke one of llguidance's limits while computing this
            # step's mask (llguidance then allows only EOS) or taking the token: a 400 for
            # this request alone, and the token, not the grammar's, is not sent.
            seq.token_ids.pop()
            seq.finish_reason, seq.error_status = "error", 400
            seq.error = (f"the grammar failed after {seq.num_output_tokens} output tokens: "
                         f"{seq.grammar.error}")
        elif seq.grammar.is_stopped and token in self.eos_token_ids:
            # Stopped by EOS. A grammar that completes on another token is not finished here:
            # its mask then allows only EOS, so the answer ends with EOS like any other "stop"
            # (whose last token the output side leaves out of the text), even with ignore_eos.
            seq.finish_reason = "stop"

    def _fail(self, seq: Sequence, message: str, status: int) -> None:
        seq.finish_reason, seq.error, seq.error_status = "error", message, status
        self._pending.append((seq.reply_to, output_for(seq)))
        self._retire(seq)

    def _drop_grammar(self, seq: Sequence) -> None:
        if seq.grammar is not None:
            seq.grammar.close()
            seq.grammar = None
        self._compiling.pop(seq.request_id, None)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        # min_tokens gates EOS and stop tokens: the first min_tokens outputs cannot stop.
        if seq.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
        if seq.num_output_tokens >= seq.max_output_tokens:
            seq.finish_reason = "length"

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._drop_grammar(seq)
        self._release_lora(seq)
        del self.sequences[seq.request_id]
        self.num_finished += 1
        observe_times(self.histograms, seq)
        if seq.trace is not None:
            self.traces.finished(seq)

    def stats(self) -> EngineStats:
        return engine_stats(self)
