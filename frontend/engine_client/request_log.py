"""--enable-log-requests / --enable-log-outputs: one structured log line per engine request
when it is sent and, with outputs, one when it finishes (vLLM's request log).

Lines are `key=value` pairs with JSON values, so they can be grepped and parsed; the prompt
is logged by its length only (its text can be long and private), the output text only under
--enable-log-outputs. Runs on the event loop, from the request tracker.
"""

from __future__ import annotations

import json
import logging

import msgspec

from shared.protocol import EngineRequest, TextFrame

log = logging.getLogger("sluice.requests")


def log_requests(enabled: bool) -> None:
    """Every per-request line (these, and the input side's) only when asked for, as in vLLM:
    a server under load would otherwise log a line per request by default."""
    log.setLevel(logging.INFO if enabled else logging.WARNING)

# Output text kept per request for --enable-log-outputs; longer answers are logged cut.
MAX_LOGGED_OUTPUT_CHARS = 4096


class RequestLog:
    def __init__(self, outputs: bool = False) -> None:
        self.outputs = outputs
        self._texts: dict[str, list[str]] = {}

    def sent(self, request: EngineRequest) -> None:
        params = msgspec.to_builtins(request.params)
        params.pop("constraint", None)  # a grammar can be megabytes; say only its kind
        if request.params.constraint is not None:
            params["constraint"] = request.params.constraint.kind
        _line("request", request_id=request.request_id,
              prompt_tokens=len(request.prompt_token_ids) // 4, params=params,
              priority=request.priority, cache_salt=request.cache_salt is not None)
        if self.outputs:
            self._texts[request.request_id] = []

    def frame(self, frame: TextFrame) -> None:
        texts = self._texts.get(frame.request_id)
        if texts is None:
            return
        texts.append(frame.text)
        if frame.finish_reason is not None:
            self.finished(frame.request_id, frame)

    def finished(self, request_id: str, frame: TextFrame | None = None) -> None:
        texts = self._texts.pop(request_id, None)
        if texts is None:
            return
        text = "".join(texts)
        _line("output", request_id=request_id,
              finish_reason=frame.finish_reason if frame else "abort",
              output_tokens=frame.num_output_tokens if frame else None,
              text=text[:MAX_LOGGED_OUTPUT_CHARS], truncated=len(text) > MAX_LOGGED_OUTPUT_CHARS)


def _line(event: str, **fields) -> None:
    log.info("%s %s", event, " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items()),
             extra={"request_id": fields.get("request_id")})
