"""A keys-file key's limits (`--api-keys-file`): what it may ask for, and its budget.

`KeyLimiter.admit` decides one request of one key, in this order: the model it names
(`models`: else a 404 `model_not_found`), its max tokens (`max_tokens_per_request`: a 400
naming the field), its requests in flight on this frontend (`max_concurrent`), then its
requests and tokens per minute, taken together from the rate windows
(`frontend.state.windows`) in the state store, so every frontend on the store shares them.

Tokens per minute count as OpenAI's API counts them: a request reserves its prompt's
estimate (its body's bytes / 4) plus max_tokens (× n) when admitted, and is refused when
that does not fit; at its end (a stream's too, finished or cut) the reservation is settled
to what it really used, prompt + completion tokens (`settle`).

Batch lines (`admit_idle`) wait for their key's budget rather than being refused, and take
at most `BATCH_SHARE` of each limit, so they never starve interactive requests.

A store that does not answer admits (`--rate-limit-store-failure open`, the default) or
refuses with a 503 (`closed`); either way it is logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgspec

from frontend.base.errors import APIError
from frontend.http import key_metrics as km
from frontend.http.key_table import KeyEntry, Principal
from frontend.state.store import StoreUnavailable
from frontend.state.windows import Charge, Taken, Window, WindowCounters, reset_s, retry_after_s

log = logging.getLogger("sluice.frontend.keys")

# Where a request without `model` means the served model (a batch or a file does not).
MODEL_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/responses/input_tokens", "/v1/embeddings",
    "/invocations", "/tokenize", "/detokenize", "/score", "/v1/score", "/rerank",
    "/v1/rerank", "/v2/rerank", "/classify", "/pooling"})
# The field each route's completion budget has when the request leaves it out.
_MAX_TOKENS_FIELD = {"/v1/chat/completions": "max_completion_tokens",
                     "/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens"}
_MAX_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
BYTES_PER_TOKEN = 4  # OpenAI's own rule of thumb for a prompt's tokens before tokenizing
# Batch lines draw from their key's budget at idle priority: up to this share of each
# per-minute limit, never the last of it, which stays for interactive requests.
BATCH_SHARE = 0.8
IDLE_POLL_S = 5.0  # the longest a waiting batch line sleeps before it looks again


class Shape(msgspec.Struct):
    """The few body fields the limits read; the route validates the whole body later."""

    model: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    max_output_tokens: Any = None
    n: Any = None


class Refusal(APIError):
    """A 429 (or the closed policy's 503): `code` names the limit, `headers` say when."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str]) -> None:
        super().__init__(status, message)
        self.code = code
        self.headers = headers


class Admitted(msgspec.Struct):
    principal: Principal
    reserved: int  # tokens reserved, to settle at the end
    index: int | None  # the tokens window they went to (None: no tokens limit, or no store)
    headers: dict[str, str]
    body: bytes | None = None  # the body as the route should read it (max tokens filled in)
    slot: bool = True  # holds a max_concurrent slot (a batch line does not)


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `6s`, `1m30s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def rate_headers(charges: list[Charge], taken: Taken, window_s: float) -> dict[str, str]:
    headers = {}
    for charge, window in zip(charges, taken.windows, strict=True):
        kind = charge.key.rsplit(":", 1)[1]
        headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(window.remaining())
        headers[f"x-ratelimit-reset-{kind}"] = duration(reset_s(window, window_s))
    return headers


def requested_max(shape: Shape) -> tuple[str, int] | None:
    for field in _MAX_FIELDS:
        value = getattr(shape, field)
        if isinstance(value, int) and not isinstance(value, bool):
            return field, value
    return None


def _with_field(body: bytes, field: str, value: int) -> bytes | None:
    """The JSON object `body` with `field` set; None for a body that is no object (the
    route refuses it)."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(data, dict):
        return None
    data[field] = value
    return msgspec.json.encode(data)


class KeyLimiter:
    def __init__(self, windows: WindowCounters, default_model: str, fail_open: bool = True,
                 clock=time.time, sleep=asyncio.sleep) -> None:
        self.windows = windows
        self.sleep = sleep
        self.default_model = default_model
        self.fail_open = fail_open
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._last_outage_log = -math.inf

    def check_model(self, entry: KeyEntry, path: str, shape: Shape | None) -> None:
        model = shape.model if shape is not None and isinstance(shape.model, str) else None
        if path.startswith("/v1/models/"):
            model = path[len("/v1/models/"):]
        elif model is None and path in MODEL_PATHS:
            model = self.default_model
        if entry.models is not None and model is not None and model not in entry.models:
            raise Refusal(404, f"The model `{model}` does not exist or you do not have access "
                               "to it.", "model_not_found", {})

    def max_tokens(self, entry: KeyEntry, path: str, shape: Shape | None,
                   body: bytes) -> tuple[int, bytes | None]:
        """(the completion tokens to reserve, the body with the cap filled in or None)."""
        asked = requested_max(shape) if shape is not None else None
        cap = entry.max_tokens_per_request
        if asked is not None and cap is not None and asked[1] > cap:
            raise APIError(400, f"{asked[0]} is {asked[1]}, more than this API key's "
                                f"max_tokens_per_request ({cap}).", asked[0])
        if asked is None and cap is not None and path in _MAX_TOKENS_FIELD:
            return cap, _with_field(body, _MAX_TOKENS_FIELD[path], cap)
        return (asked[1] if asked else cap or 0), None

    def _reserve(self, entry: KeyEntry, path: str, body: bytes | None,
                 shape: Shape | None) -> tuple[int, bytes | None]:
        """(tokens to reserve, the body with max tokens filled in or None), after the
        model and max-tokens checks."""
        self.check_model(entry, path, shape)
        completion, new_body = self.max_tokens(entry, path, shape, body or b"")
        n = shape.n if shape is not None and isinstance(shape.n, int) and shape.n > 0 else 1
        # Only what runs the model spends tokens (an uploaded file does not).
        reserved = (math.ceil(len(body or b"") / BYTES_PER_TOKEN) + completion * n
                    if body and path in MODEL_PATHS else 0)
        return reserved, new_body

    async def admit(self, principal: Principal, path: str, body: bytes | None,
                    shape: Shape | None) -> Admitted:
        reserved, new_body = self._reserve(principal.entry, path, body, shape)
        self._enter(principal)
        try:
            index, headers = await self._take(principal, reserved)
        except BaseException:
            self.leave(principal)
            raise
        return Admitted(principal, reserved, index, headers, new_body)

    async def admit_idle(self, principal: Principal, path: str, body: bytes,
                         shape: Shape | None) -> Admitted:
        """A batch line of the key: it waits, never refused for the budget, until it fits
        within BATCH_SHARE of each per-minute limit, so interactive requests always have
        the rest. It holds no `max_concurrent` slot (--max-batch-lines-in-flight bounds
        lines); a line that could never fit is a 429."""
        reserved, new_body = self._reserve(principal.entry, path, body, shape)
        charges = [Charge(c.key, c.cost, max(1, math.floor(c.limit * BATCH_SHARE)))
                   for c in self._charges(principal, reserved)]
        if too_big := next((c for c in charges if c.cost > c.limit), None):
            raise Refusal(429, f"This batch line needs about {too_big.cost} tokens, more than "
                               f"a batch line of API key '{principal.name}' may use in a "
                               f"minute ({too_big.limit}).", "tokens_per_minute", {})
        index = await self._wait_idle(charges) if charges else None
        has_tokens = principal.entry.tokens_per_minute is not None
        return Admitted(principal, reserved, index if has_tokens else None, {}, new_body,
                        slot=False)

    async def _wait_idle(self, charges: list[Charge]) -> int | None:
        while True:
            try:
                taken = await self.windows.take(charges, self.clock())
            except StoreUnavailable as exc:
                try:
                    self._outage(exc)
                    return None  # open: run it uncounted
                except Refusal:
                    await self.sleep(1.0)  # closed: wait for the store
                    continue
            if taken.admitted:
                return taken.windows[0].index
            wait = retry_after_s(taken.windows[taken.refused], charges[taken.refused].cost,
                                 self.windows.window_s)
            await self.sleep(min(max(wait, 0.05), IDLE_POLL_S))

    def _enter(self, principal: Principal) -> None:
        cap, name = principal.entry.max_concurrent, principal.name
        if cap is not None and self.in_flight.get(name, 0) >= cap:
            raise Refusal(429, f"Too many requests in flight for API key '{name}': its "
                               f"max_concurrent is {cap}.", "max_concurrent",
                          {"Retry-After": "1"})
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        km.IN_FLIGHT.labels(name).inc()

    def leave(self, principal: Principal) -> None:
        self.in_flight[principal.name] -= 1
        km.IN_FLIGHT.labels(principal.name).dec()

    def _charges(self, principal: Principal, reserved: int) -> list[Charge]:
        entry, name = principal.entry, principal.name
        charges = []
        if entry.requests_per_minute is not None:
            charges.append(Charge(f"{name}:requests", 1, entry.requests_per_minute))
        if entry.tokens_per_minute is not None:
            charges.append(Charge(f"{name}:tokens", reserved, entry.tokens_per_minute))
        return charges

    async def _take(self, principal: Principal, reserved: int) -> tuple[int | None, dict]:
        charges = self._charges(principal, reserved)
        if not charges:
            return None, {}
        try:
            taken = await self.windows.take(charges, self.clock())
        except StoreUnavailable as exc:
            self._outage(exc)
            return None, {}
        headers = rate_headers(charges, taken, self.windows.window_s)
        if not taken.admitted:
            raise self._refusal(principal, charges[taken.refused],
                                taken.windows[taken.refused], headers)
        has_tokens = principal.entry.tokens_per_minute is not None
        return (taken.windows[0].index if has_tokens else None), headers

    def _refusal(self, principal: Principal, charge: Charge, window: Window,
                 headers: dict[str, str]) -> Refusal:
        kind = charge.key.rsplit(":", 1)[1]
        wait = retry_after_s(window, charge.cost, self.windows.window_s)
        headers["Retry-After"] = str(max(1, math.ceil(wait)))
        field = f"{kind}_per_minute"
        if charge.cost > charge.limit:
            message = (f"This request needs about {charge.cost} tokens, more than API key "
                       f"'{principal.name}' may use in a minute ({field} {charge.limit}).")
        else:
            message = (f"Rate limit reached for API key '{principal.name}' on {kind} per "
                       f"minute: limit {charge.limit}, used {math.ceil(window.used())}, "
                       f"requested {charge.cost}. Please try again in {duration(wait)}.")
        return Refusal(429, message, field, headers)

    def _outage(self, exc: StoreUnavailable) -> None:
        policy = "open" if self.fail_open else "closed"
        km.STORE_FAILURES.labels(policy).inc()
        now = time.monotonic()
        if now - self._last_outage_log > 10:  # once in a while, not once per request
            self._last_outage_log = now
            log.warning("rate limits: %s; failing %s (--rate-limit-store-failure)",
                        exc.message, policy)
        if not self.fail_open:
            raise Refusal(503, "The rate-limit store is unavailable and this server fails "
                               "closed (--rate-limit-store-failure closed); retry shortly.",
                          "rate_limit_store_unavailable", {"Retry-After": "1"})

    async def settle(self, admitted: Admitted, prompt: int, output: int) -> None:
        """The request ended: its reservation becomes what it used; its slot frees."""
        name = admitted.principal.name
        km.PROMPT_TOKENS.labels(name).inc(prompt)
        km.GENERATION_TOKENS.labels(name).inc(output)
        if admitted.slot:
            self.leave(admitted.principal)
        delta = prompt + output - admitted.reserved
        if admitted.index is None or delta == 0:
            return
        try:
            await self.windows.adjust(f"{name}:tokens", admitted.index, delta)
        except StoreUnavailable as exc:
            self._outage_logged(exc)

    def _outage_logged(self, exc: StoreUnavailable) -> None:
        km.STORE_FAILURES.labels("settle").inc()
        log.warning("rate limits: a settle was lost: %s", exc.message)
