"""The engine process: loads the model, then runs the busy loop with socket I/O on threads.

Threads: one receives requests, aborts and pings (and answers pings itself, so heartbeats
flow even during a long step; a frontend connection that stops sending for
--frontend-timeout has its requests aborted); one encodes and routes outputs to postproc workers or
frontends (`engine.output_router`). The main thread only drains
the inbox, steps the model and hands outputs over, so compute overlaps with (de)serialization.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import sys
import threading
import time

import msgspec
import torch
import zmq

from engine.attention.selector import (
    BackendUnavailable,
    create_attention_backend,
    select_attention_backend,
)
from engine.core import EngineCore
from engine.device import resolve_dtype
from engine.grammar import GrammarBackend
from engine.kv_cache import PageAllocator
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig, load_model_config
from engine.models.llama import LlamaModel
from engine.models.ops import make_ops
from engine.models.weights import load_quantized_weights, load_weights
from engine.output_router import FleetCounts, OutputRouter
from engine.scheduler import Scheduler
from shared.codec import encode, engine_inbound_decoder
from shared.config import EngineConfig
from shared.protocol import AbortRequest, EngineRequest, EngineStats, Ping
from shared.tokenizer import load_tokenizer, tokenizer_facts
from shared.transport import make_socket

log = logging.getLogger("sluice.engine")

# ---------------------------------------------------------------- construction


def kv_pages_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    if config.num_pages is not None:
        return config.num_pages
    element = torch.empty((), dtype=dtype).element_size()
    per_page = 2 * model.num_layers * config.page_size * model.num_kv_heads * model.head_dim
    return max(1, int(config.kv_cache_memory_gb * 2**30) // (per_page * element))


# Besides weights, KV cache and activations a GPU engine holds FlashInfer's workspaces
# (128 MiB float, 8 MiB int per wrapper), the CUDA-graph memory pool, cuBLAS workspaces and
# allocator slack; 1 GiB covers them for the models we serve.
GPU_FIXED_RESERVE_BYTES = 2**30


def gpu_activation_reserve(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes a step's activations may take at most, estimated from the step's token budget:
    the tensors live at once inside one layer (residual, normed input, q/k/v and their
    rotated copies, attention output, gate/up, SiLU output), the float32 logits of
    max_num_seqs rows with the sampler's copies of them (softmax, sort, cumsum), and the
    fixed reserve. Prompt logprobs of a long prefill chunk come out of what
    --gpu-memory-utilization leaves free."""
    element = torch.empty((), dtype=dtype).element_size()
    q_size = model.num_heads * model.head_dim
    kv_size = model.num_kv_heads * model.head_dim
    per_token = 4 * model.hidden_size + 2 * (q_size + 2 * kv_size) + 3 * model.intermediate_size
    activations = config.max_num_batched_tokens * per_token * element
    logits = config.max_num_seqs * model.vocab_size * 4 * 6
    return activations + logits + GPU_FIXED_RESERVE_BYTES


def gpu_kv_pages(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """KV pages that fit in --gpu-memory-utilization of the GPU's memory, once the weights
    are on it (call after loading) and the activation reserve is set aside. Memory other
    processes hold on the GPU counts as used."""
    if config.num_pages is not None:
        return config.num_pages
    if not 0 < config.gpu_memory_utilization <= 1:
        raise SystemExit(
            f"--gpu-memory-utilization must lie in (0, 1], not {config.gpu_memory_utilization}"
        )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = (config.gpu_memory_utilization * total - (total - free)
              - gpu_activation_reserve(config, model, dtype))
    element = torch.empty((), dtype=dtype).element_size()
    per_page = 2 * model.num_layers * config.page_size * model.num_kv_heads * model.head_dim
    return max(1, int(budget) // (per_page * element))


def _check_cache_holds(num_pages: int, config: EngineConfig, max_model_len: int) -> None:
    if num_pages * config.page_size < max_model_len:
        more = ("raise --gpu-memory-utilization" if config.device.startswith("cuda")
                else "give it more memory")
        raise SystemExit(
            f"the KV cache ({num_pages} pages of {config.page_size} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len}; {more} or lower --max-model-len"
        )


def build_engine(config: EngineConfig) -> EngineCore:
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.seed is not None:
        torch.manual_seed(config.seed)  # CPU and every CUDA device
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    try:
        choice = select_attention_backend(config.attention_backend, device, dtype)
    except BackendUnavailable as exc:
        raise SystemExit(str(exc)) from None
    log.info("attention backend: %s (%s)", choice.name, choice.reason)
    model_config = load_model_config(config.model)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is not None:
        torch.cuda.set_device(device)  # streams, graphs and kernel workspaces follow it
    if not on_gpu:  # sized up front; on a GPU the cache gets what the weights leave
        num_pages = kv_pages_for(config, model_config, dtype)
        _check_cache_holds(num_pages, config, max_model_len)
    started = time.monotonic()
    weights = load_weights(config.model, model_config, torch.float32)
    ops = make_ops(choice.name, device)
    quantized = load_quantized_weights(config.model, model_config) if device.type == "cpu" else {}
    model = LlamaModel(model_config, weights, max_model_len, dtype, device, ops=ops,
                       quantized=quantized)
    del weights
    log.info("loaded %s (%s, %s ops) in %.1fs", config.served_model_name, dtype,
             model.ops.name, time.monotonic() - started)
    if on_gpu:
        num_pages = gpu_kv_pages(config, model_config, dtype, device)
        _check_cache_holds(num_pages, config, max_model_len)
        log.info("KV cache: %d pages of %d tokens", num_pages, config.page_size)
    backend = create_attention_backend(
        choice.name, model_config, num_pages, config.page_size, dtype, device
    )
    if choice.name == "flashinfer" and not config.enforce_eager:
        from engine.cuda_graphs import DecodeGraphModel, graph_batch_sizes

        model = DecodeGraphModel(
            model, backend, graph_batch_sizes(config.max_num_seqs), max_model_len
        )
        model.capture()
    allocator = PageAllocator(num_pages, config.page_size)
    tokenizer = load_tokenizer(config.model)
    facts = tokenizer_facts(tokenizer, config.model)
    return EngineCore(
        ModelRunner(model, backend, model_config.vocab_size),
        allocator,
        Scheduler(allocator, config.max_num_batched_tokens, config.max_num_seqs,
                  config.scheduling_policy, config.long_prefill_token_threshold),
        eos_token_ids=facts.eos_token_ids,
        max_model_len=max_model_len,
        vocab_size=model_config.vocab_size,
        engine_id=config.engine_id,
        model_name=config.served_model_name,
        grammar=GrammarBackend(tokenizer, model_config.vocab_size, facts.eos_token_ids),
    )


# ---------------------------------------------------------------- the process


class Submitted(msgspec.Struct):
    """A request with the ROUTER identity of the connection it came on."""

    request: EngineRequest
    peer: bytes


class PeerGone(msgspec.Struct):
    """A frontend connection that stopped heartbeating: its requests are for nobody."""

    peer: bytes


class CloseResultSockets(msgspec.Struct):
    """For the send thread: stop pushing to these frontends (after their last outputs)."""

    addresses: list[str]


class PeerWatch:
    """Which connections heartbeat, and which went silent (the receive thread's).

    Only a connection that has sent a Ping is watched: one that never pings (a bare test
    client) cannot be told from a dead one. Any message counts as a sign of life. If this
    thread itself did not run for a while (the engine was stopped or starved), nobody is
    blamed for the gap: every clock restarts."""

    STALL_S = 1.0  # the receive thread ticks every 0.1 s; a longer gap is our own stall

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_heard: dict[bytes, float] = {}
        self._last_tick = time.monotonic()

    def heard(self, peer: bytes, is_ping: bool) -> None:
        if is_ping or peer in self._last_heard:
            self._last_heard[peer] = time.monotonic()

    def silent(self) -> list[bytes]:
        """Connections silent past the timeout, forgotten as they are returned."""
        now = time.monotonic()
        gap, self._last_tick = now - self._last_tick, now
        if gap > self.STALL_S:
            for peer in self._last_heard:
                self._last_heard[peer] += gap
        if self.timeout_s <= 0:
            return []
        gone = [p for p, t in self._last_heard.items() if now - t > self.timeout_s]
        for peer in gone:
            del self._last_heard[peer]
        return gone


class EngineServer:
    def __init__(
        self, core: EngineCore, request_address: str, postproc_address: str | None = None,
        frontend_timeout_s: float = 10.0,
    ) -> None:
        self.core = core
        self.request_address = request_address
        self.postproc_address = postproc_address
        self.ctx = zmq.Context()
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.latest_stats = core.stats()
        self.fleet_counts = FleetCounts()
        self.peers = PeerWatch(frontend_timeout_s)

    def run(self) -> None:
        bound = threading.Event()
        threads = [
            threading.Thread(target=self._receive_loop, args=(bound,), name="engine-recv",
                             daemon=True),
            threading.Thread(target=self._send_loop, name="engine-send", daemon=True),
        ]
        for t in threads:
            t.start()
        bound.wait()
        log.info("engine ready on %s", self.request_address)
        try:
            self._busy_loop()
        finally:
            self.stopping.set()
            self.outbox.put(None)
            for t in threads:
                t.join(timeout=2)
            self.ctx.term()

    def _busy_loop(self) -> None:
        core = self.core
        while not self.stopping.is_set():
            abandoned = self._drain_inbox(block=not core.has_work)
            if core.has_work:
                started = time.perf_counter()
                outputs = core.step()
                if outputs:
                    self.outbox.put((outputs, time.perf_counter() - started))
            if abandoned:
                # After the abort outputs above, so whoever still listens gets them.
                self.outbox.put(CloseResultSockets(abandoned))
            self.latest_stats = core.stats()

    def _drain_inbox(self, block: bool) -> list[str]:
        """Hands every message to the core; returns the result addresses that no request
        uses any more because their frontend went silent."""
        abandoned: list[str] = []
        try:
            message = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return abandoned
        while True:
            if isinstance(message, Submitted):
                self.core.add(message.request, peer=message.peer)
            elif isinstance(message, EngineRequest):
                self.core.add(message)
            elif isinstance(message, AbortRequest):
                self.core.abort(message.request_ids)
            elif isinstance(message, PeerGone):
                abandoned.extend(self.core.abort_peer(message.peer))
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return abandoned

    def _receive_loop(self, bound: threading.Event) -> None:
        sock = make_socket(self.ctx, zmq.ROUTER)
        sock.bind(self.request_address)
        bound.set()
        decoder = engine_inbound_decoder()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self.stopping.is_set():
            for peer in self.peers.silent():
                self.inbox.put(PeerGone(peer))
            if not poller.poll(100):
                continue
            identity, payload = sock.recv_multipart(copy=False)
            try:
                message = decoder.decode(payload.buffer)
            except Exception as exc:  # a bad peer must not take the engine down
                log.warning("dropping undecodable message: %s", exc)
                continue
            self.peers.heard(identity.bytes, isinstance(message, Ping))
            if isinstance(message, Ping):
                sock.send_multipart([identity, encode(self._stats())])
                continue
            if isinstance(message, EngineRequest):
                self.outbox.put(message)  # the router learns of it before its first output
                message = Submitted(message, identity.bytes)
            self.inbox.put(message)
        sock.close(linger=0)

    def _stats(self) -> EngineStats:
        fleet = self.fleet_counts
        return msgspec.structs.replace(
            self.latest_stats, num_postproc_workers=fleet.live_workers,
            postproc_assigned=fleet.assigned, postproc_replayed=fleet.replayed,
        )

    def _send_loop(self) -> None:
        """Routes outputs to postproc workers or frontends; between batches it takes the
        workers' heartbeats, so a short wait keeps them flowing when the engine is idle."""
        router = OutputRouter(self.ctx, self.postproc_address)
        self.fleet_counts = router.counts
        try:
            while True:
                try:
                    item = self.outbox.get(timeout=0.05)
                except queue.Empty:
                    item = ()
                if item is None:
                    break
                if isinstance(item, EngineRequest):
                    router.add_request(item)
                elif isinstance(item, CloseResultSockets):
                    router.close_frontends(item.addresses)
                elif item:
                    router.route(*item)
                for abort in router.poll_workers():
                    self.inbox.put(abort)  # a worker matched a stop string
        finally:
            router.close()


def run_engine(config: EngineConfig) -> None:
    core = build_engine(config)
    # Everything loaded so far (torch, transformers, the tokenizer: ~400k objects) lives as
    # long as the process; frozen, the cyclic GC stops re-walking it in the middle of steps.
    gc.collect()
    gc.freeze()
    server = EngineServer(core, config.request_address, config.postproc_address,
                          config.frontend_timeout_s)

    def stop(signum, frame):
        server.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.run()
    except Exception:
        # A failed step leaves the cache and scheduler untrustworthy: exit non-zero so an
        # orchestrator restarts the engine (frontends answer 503 meanwhile).
        log.exception("engine fault; exiting")
        sys.exit(1)
