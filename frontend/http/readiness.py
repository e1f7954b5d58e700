"""When a frontend can answer: the one notion behind `/health`, `/ping` and the "ready" line
that `sluice serve` (and so `make serve`) prints.

Ready means a request sent now would be served: the HTTP socket is bound, an engine answers
the heartbeat, and the frontend is not draining. Before the first engine answers, requests
get `503 The engine is not available`, so nothing may say "running" before this does.
"""

from __future__ import annotations

import asyncio
import logging

from frontend.http.limits import DRAINING_HEADERS, RETRY_AFTER_S, Admission

log = logging.getLogger("sluice")

# How often the announcer looks: the line follows the engine's first heartbeat this closely.
POLL_S = 0.1


class Readiness:
    def __init__(self, client, admission: Admission) -> None:
        self.client = client
        self.admission = admission

    @property
    def ready(self) -> bool:
        """Whether a request would be served now (the socket is bound: someone asked)."""
        return self.client.engine_alive and not self.admission.draining

    def not_ready_headers(self) -> dict[str, str]:
        """/health's 503: draining, as every draining 503; else retry when an engine is back."""
        return DRAINING_HEADERS if self.admission.draining else {"Retry-After":
                                                                  str(RETRY_AFTER_S)}

    async def announce(self, url: str, model: str) -> None:
        """Logs one plain line each time the frontend becomes ready: where, what, how to
        stop. Started once the HTTP socket is bound; runs for the server's life."""
        was_ready = False
        while True:
            ready = self.ready
            if ready and not was_ready:
                log.info("ready: %s serves %s (Ctrl+C to stop)", url, model)
            was_ready = ready
            await asyncio.sleep(POLL_S)
