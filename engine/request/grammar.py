"""Grammar-constrained decoding with llguidance (req P-8, O-4, C-1 to C-3).

The frontend sends each constrained request's grammar already translated and validated
(`shared.protocol.Constraint`). Here:

- `GrammarBackend` holds llguidance's view of the tokenizer (built once) and compiles a
  request's grammar into an `LLMatcher` on a worker thread, so a slow grammar never stalls the
  step loop: the request waits in the scheduler (`Sequence.awaiting_grammar`) while others run.
  It compiles under `shared.grammar_limits` (the frontend's table: a grammar past a bound is
  refused before llguidance sees it), on deep-stack threads, and computes the first mask
  there too, so a grammar that fails at compile or at its first mask is a 400 before any
  token. A matcher that fails later (a limit hit mid-answer) fails only its request.
- Each step, `step_masks` (the backend's `fill_masks`) computes one allowed-token bitmask
  per constrained row (in parallel, on llguidance's own threads, while the device runs the
  forward pass) and `GrammarMasks.apply` sets every disallowed logit to -inf before
  sampling, so logprobs only give mass to tokens the grammar allows (O-4).
- The sampled token advances the request's matcher (`RequestGrammar.advance`); a matcher that
  has stopped (the grammar is complete, or EOS was taken in an accepting state) ends the
  request. Matchers only move on sampled tokens, so a preempted request that is recomputed
  finds its matcher exactly where it left it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait

import llguidance
import llguidance.hf
import msgspec
import torch

from shared.grammar_limits import DeepStackThreads, compile_matcher
from shared.protocol import Constraint

_CACHE_SIZE = 64  # compiled grammars kept for reuse (n > 1 candidates, repeated schemas)


class RequestGrammar:
    """One request's matcher: compiling until `poll` finds it ready, then advanced per token."""

    def __init__(self, backend: GrammarBackend, future: Future) -> None:
        self.backend = backend
        self._future = future
        self.matcher: llguidance.LLMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def compiled(self) -> bool:
        return self._future.done()

    def poll(self) -> str | None:
        """Once compiling is done: take the matcher; returns the grammar's error, if any."""
        if self.matcher is not None or not self._future.done():
            return None
        try:
            matcher = self._future.result()
        except BaseException as exc:  # noqa: BLE001 - llguidance's panics are BaseExceptions
            return f"llguidance failed: {type(exc).__name__}: {exc}"
        if isinstance(matcher, str):
            return matcher
        self.matcher = matcher
        return None

    @property
    def failed(self) -> bool:
        """The matcher broke (a limit hit while computing its mask): llguidance then allows
        only EOS, and that token is not the grammar's."""
        return self.matcher is not None and self.matcher.is_error()

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False if the grammar rejects it (the mask should prevent it)."""
        return self.matcher.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher is not None else ""

    def close(self) -> None:
        """The request ended: drop the matcher, and the compile job if it has not started."""
        self._future.cancel()
        self.matcher = None


class GrammarMasks(msgspec.Struct):
    """One step's bitmasks: row `i` of `bitmask` belongs to logits row `rows[i]`."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], on the CPU
    backend: GrammarBackend  # the one that filled them, and knows how to apply them

    def apply(self, logits: torch.Tensor) -> None:
        """In place: disallowed tokens of each constrained row get -inf."""
        self.backend.apply_masks(logits, self)


def step_masks(grammars: list[RequestGrammar | None]) -> GrammarMasks | None:
    """Bitmasks for one step's sampled rows (one entry each, None where unconstrained), from
    the backend that compiled their grammars; None when no row is constrained."""
    first = next((g for g in grammars if g is not None), None)
    return None if first is None else first.backend.fill_masks(grammars)


class GrammarBackend:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        compile_threads: int = 2,
        mask_threads: int | None = None,
    ) -> None:
        """`tokenizer`: the model's HF fast tokenizer; `vocab_size`: the logits' width (the
        model may have more rows than the tokenizer has tokens: those are never allowed)."""
        n_vocab = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = DeepStackThreads(compile_threads, "grammar")
        self._executor = llguidance.LLExecutor(num_threads=mask_threads)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bitmask = _new_bitmask(1, n_vocab)
        self._shifts: dict[torch.device, torch.Tensor] = {}

    # ---------------------------------------------------------------- compiling

    def compile(self, constraint: Constraint) -> RequestGrammar:
        """Starts compiling on a worker thread; the result is ready when `poll` says so."""
        return RequestGrammar(self, self._compiler.submit(self._matcher, constraint.grammar))

    def _matcher(self, grammar: str) -> llguidance.LLMatcher | str:
        """A matcher ready for its first mask, or why the grammar cannot run."""
        with self._cache_lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                return cached.deep_copy()
        matcher = compile_matcher(self.tokenizer, grammar)
        if not isinstance(matcher, str):
            with self._cache_lock:
                self._cache[grammar] = matcher.deep_copy()
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return matcher

    @staticmethod
    def wait_any(grammars: list[RequestGrammar], timeout: float) -> None:
        """Blocks until one of these finishes compiling, or the timeout: the step loop's idle
        wait when nothing else can run, instead of spinning."""
        wait([g._future for g in grammars], timeout=timeout, return_when=FIRST_COMPLETED)

    # ---------------------------------------------------------------- masks

    def fill_masks(self, grammars: list[RequestGrammar | None]) -> GrammarMasks | None:
        """Bitmasks for the constrained rows among `grammars` (one entry per sampled row)."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = _new_bitmask(len(rows), self.tokenizer.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        pairs = [(grammars[row].matcher, k) for k, row in enumerate(rows)]
        # The bitmask is a contiguous CPU int32 tensor: llguidance's threads write each
        # row's words in place.
        words = bitmask.shape[1]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
        return GrammarMasks(rows, bitmask, self)

    def apply_masks(self, logits: torch.Tensor, masks: GrammarMasks) -> None:
        """In place: disallowed tokens of each constrained row get -inf."""
        device = logits.device
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        words = masks.bitmask.to(device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
        rows = torch.tensor(masks.rows, device=device)
        masked = logits[rows].masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(masked).all(dim=1)
        if dead.any():
            # min_tokens banned everything the grammar still allows (a finished answer whose
            # only way on is EOS): the grammar wins, so the request ends instead of failing.
            masked[dead] = torch.where(allowed[dead], 0.0, float("-inf"))
        logits[rows] = masked


def _new_bitmask(rows: int, n_vocab: int) -> torch.Tensor:
    """`rows` bitmasks of ceil(n_vocab / 32) int32 words, all allowed, pinned when a CUDA
    device will read them. Our own, not llguidance.torch's: importing that module runs a
    torch.compile decorator, which loads dynamo and inductor (3 s of every engine start)."""
    shape = (rows, (n_vocab + 31) // 32)
    if torch.cuda.is_available():
        try:
            return torch.full(shape, -1, dtype=torch.int32, pin_memory=True)
        except RuntimeError:  # no pinnable memory left: a pageable copy still works
            pass
    return torch.full(shape, -1, dtype=torch.int32)
