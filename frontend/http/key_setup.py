"""`--api-keys-file`'s parts, put together once per app: the table (reloaded on SIGHUP and
when the file changes), the limiter over the state store's rate windows, and the two
middlewares (`frontend.http.key_middleware`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import msgspec
from starlette.middleware import Middleware

from frontend.base.errors import APIError
from frontend.engine_client.admission import KeyMeter, current_meter
from frontend.http.key_limits import KeyLimiter, Shape
from frontend.http.key_middleware import KeyAuthMiddleware, KeyLimitMiddleware, refusal_response
from frontend.http.key_table import KeyTable
from frontend.state.store import StateStore
from frontend.state.window_stores import windows_for
from shared.config import FrontendConfig

log = logging.getLogger("sluice.frontend.keys")
WATCH_S = 1.0  # how often the file's mtime is looked at


class KeyService(msgspec.Struct):
    table: KeyTable
    limiter: KeyLimiter


def open_keys(config: FrontendConfig, state: StateStore) -> KeyService | None:
    if config.api_keys_file is None:
        return None
    table = KeyTable(config.api_keys_file, config.api_keys)
    windows = windows_for(state)
    if not windows.shared:
        log.warning("--api-keys-file with --state-store memory://: this frontend counts "
                    "the keys' per-minute budgets alone; other frontends count their own")
    fail_open = config.rate_limit_store_failure == "open"
    log.info("--api-keys-file %s: %d keys, budgets %s, store failure: fail %s",
             config.api_keys_file, len(table.principals),
             "shared through the state store" if windows.shared else "per frontend",
             "open" if fail_open else "closed")
    return KeyService(table, KeyLimiter(windows, config.served_model_name, fail_open))


def middleware(keys: KeyService) -> tuple[Middleware, Middleware]:
    """(the auth, where --api-key's check goes; the limits, after the body limit)."""
    return (Middleware(KeyAuthMiddleware, table=keys.table),
            Middleware(KeyLimitMiddleware, limiter=keys.limiter))


@contextlib.asynccontextmanager
async def watching(keys: KeyService | None):
    """While the app serves: SIGHUP reloads the file, and so does a change of its mtime."""
    if keys is None:
        yield
        return
    loop = asyncio.get_running_loop()
    table = keys.table
    loop.add_signal_handler(signal.SIGHUP, table.reload, "SIGHUP")

    async def poll():
        while True:
            await asyncio.sleep(WATCH_S)
            table.check_changed()

    task = asyncio.create_task(poll())
    try:
        yield
    finally:
        task.cancel()
        loop.remove_signal_handler(signal.SIGHUP)


async def batch_line(keys: KeyService | None, owner: str | None, path: str, body: bytes,
                     run) -> tuple[int, bytes]:
    """A batch line through its key's limits (`KeyLimiter.admit_idle`): it waits for the
    budget, runs (`run(body)`: the route's (status, body)), and settles its tokens."""
    principal = keys.table.by_owner(owner) if keys is not None else None
    if principal is None or principal.entry is None:
        return await run(body)
    try:
        shape = msgspec.json.decode(body, type=Shape)
    except msgspec.DecodeError:
        shape = None
    try:
        admitted = await keys.limiter.admit_idle(principal, path, body, shape)
    except APIError as error:
        response = refusal_response(error, path, {})
        return response.status_code, bytes(response.body)
    meter = KeyMeter(priority_floor=principal.entry.priority)
    token = current_meter.set(meter)
    try:
        return await run(admitted.body or body)
    finally:
        current_meter.reset(token)
        await keys.limiter.settle(admitted, *meter.totals())
