"""TensorRT-LLM's operator routes (seed 000's route table): /health_generate, /server_info,
/steady_clock_offset, /start_profile and /stop_profile, /energy_metrics.

- /health_generate runs a real one-token completion through the whole stack (render,
  tokenize, engine, post-process), as trtllm-serve's does: 200 when it comes back, 503 when
  it does not within --health-generate-timeout (a frozen engine) or no engine is live.
- /server_info is trtllm-serve's answer, `{"disaggregated_params": ...}` (None: this server
  runs no prefill/decode split), with sluice's model, version and steady-clock offset.
- /steady_clock_offset: GET answers the steady clock (time.monotonic) at the request's
  arrival and at its answer, for a disaggregation router to estimate the offset between its
  clock and this server's, NTP-style; POST {"offset": seconds} records the router's result.
- /start_profile and /stop_profile run the torch profiler in every live engine (it must be
  started with --profile-dir; else 404); the stop answers each trace file's path.
- /energy_metrics: every live engine's energy counters (RAPL, NVML; engine.process.energy);
  404 where no engine's machine reports any.
- POST /kv_cache_events: the engines' KV events since the last call, in trtllm-serve's shape
  (frontend.http.kv_cache_events); [] when no engine publishes (--kv-events-config).
"""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from frontend.base.api_models import CompletionRequest
from frontend.base.errors import APIError
from frontend.engine_client.engine_commands import run_on_engines
from frontend.http.kv_cache_events import trtllm_events
from frontend.openai import serving
from shared.protocol import EnergyReading

# Largest clock offset a router may record: a day, far past any real one; NaN and inf out.
MAX_CLOCK_OFFSET_S = 86400.0


class ClockOffset(msgspec.Struct, forbid_unknown_fields=True):
    offset: float


class ServerInfo(msgspec.Struct):
    disaggregated_params: dict | None
    model: str
    version: str
    steady_clock_offset: float  # seconds, as a router last recorded it (POST)
    engines: int  # live engines


class EngineEnergy(msgspec.Struct):
    engine_id: str
    readings: list[EnergyReading]


class EnergyMetrics(msgspec.Struct):
    timestamp: float  # when the frontend gathered them (epoch seconds)
    engines: list[EngineEnergy]
    object: str = "energy_metrics"


class ProfileTrace(msgspec.Struct):
    engine_id: str
    path: str


class ProfileStopped(msgspec.Struct):
    traces: list[ProfileTrace]


class EngineOps:
    """The handlers, over the app's context; `clock_offset` is what POST recorded."""

    def __init__(self, app, version: str) -> None:
        self.app = app
        self.version = version
        self.clock_offset = 0.0

    async def health_generate(self, request: Request) -> Response:
        """200 with trtllm-serve's text; every failure a 503 in the one error shape."""
        if not self.app.readiness.ready:
            raise APIError(503, "No engine is available; try again shortly.")
        bound = self.app.config.health_generate_timeout_s
        probe = CompletionRequest(prompt="hi", max_tokens=1, temperature=0.0)
        try:
            answer = await asyncio.wait_for(serving.completion(self.app.ctx, request, probe),
                                            bound)
        except TimeoutError:
            raise APIError(503, f"the engine did not generate within {bound:g} s") from None
        except APIError as exc:  # the stack refused it: unhealthy, whatever the reason
            raise APIError(503, f"generation health check failed: {exc.message}") from None
        if answer.status_code != 200:
            raise APIError(503, "generation health check failed")
        return PlainTextResponse("Generation health check OK")

    async def server_info(self, request: Request) -> Response:
        return _json(ServerInfo(None, self.app.ctx.model_name, self.version, self.clock_offset,
                                len(self.app.ctx.client.live_engines())))

    async def get_clock(self, request: Request) -> Response:
        received = time.monotonic()
        return _json({"receive_ts": received, "transmit_ts": time.monotonic()})

    async def set_clock(self, request: Request) -> Response:
        body = await self.app.decode(request, ClockOffset)
        if not math.isfinite(body.offset) or abs(body.offset) > MAX_CLOCK_OFFSET_S:
            raise APIError(400, f"offset must be a finite number of seconds within "
                                f"±{MAX_CLOCK_OFFSET_S:g}", "offset")
        self.clock_offset = body.offset
        return Response(status_code=200)

    async def start_profile(self, request: Request) -> Response:
        await self._all_engines("start_profile")
        return Response(status_code=200)

    async def stop_profile(self, request: Request) -> Response:
        results = await self._all_engines("stop_profile")
        return _json(ProfileStopped([ProfileTrace(e, r.path) for e, r in results]))

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's: every live engine forgets its cached prefixes (409 while one runs)."""
        await self._all_engines("reset_prefix_cache")
        return Response(status_code=200)

    async def energy_metrics(self, request: Request) -> Response:
        results = await self._engine_results("read_energy")
        found = [EngineEnergy(e, r.energy) for e, r in results if r.status == 200]
        if not found:
            failed = next((r for _, r in results if r.status != 404), results[0][1])
            raise APIError(failed.status, failed.message)
        return _json(EnergyMetrics(time.time(), found))

    async def kv_cache_events(self, request: Request) -> Response:
        client = self.app.ctx.client
        return _json(trtllm_events(client.kv_journal.drain(), client.engines))

    async def _all_engines(self, command: str) -> list:
        """The command's answers when every engine did it; else the first problem's error."""
        results = await self._engine_results(command)
        for _, result in results:
            if result.status != 200:
                raise APIError(result.status, result.message)
        return results

    async def _engine_results(self, command: str) -> list:
        if not self.app.ctx.client.live_engines():
            raise APIError(503, "No engine is available; try again shortly.")
        return await run_on_engines(self.app.ctx.client, command)


_encoder = msgspec.json.Encoder()


def _json(body) -> Response:
    return Response(_encoder.encode(body), media_type="application/json")
