"""CUDA graphs for decode steps.

A decode step of a small model is mostly kernel-launch overhead: dozens of small kernels
per layer, one token per sequence. So at startup the engine captures the whole model
forward (embedding to final hidden states, attention included) once per batch size in
`graph_batch_sizes` (1, 2, 4, ... up to --max-num-seqs), and replays a graph for every
decode-only step instead of launching kernels one by one. A batch of n decodes runs in the
smallest captured size >= n; the padding rows read token 0 at position 0 and touch only the
backend's scratch page (see `engine.attention.flashinfer_backend.pad_decode`).

What changes per replay lives in static buffers the graph reads: token ids and positions
(here), the slot mapping (the backend's per-size metadata) and the page table (FlashInfer's
CUDA-graph decode wrapper, re-planned by `prepare` before each replay). Prefill and mixed
steps, and decode batches larger than the largest graph, run eagerly.

`DecodeGraphModel` wraps the model with the same `forward`/`logits`/`device` as
`LlamaModel`, so the model runner does not know graphs exist. Only the flashinfer backend
supports graphs: the torch backend's decode metadata changes shape with context length.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("sluice.engine")


def graph_batch_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """Decode batch sizes to capture: powers of two up to min(max_num_seqs, largest), plus
    that bound itself when it is not a power of two."""
    bound = max(1, min(max_num_seqs, largest))
    sizes = [1 << i for i in range(bound.bit_length())]
    if sizes[-1] != bound:
        sizes.append(bound)
    return sizes


class DecodeGraphModel:
    def __init__(self, model, backend, batch_sizes: list[int], max_model_len: int) -> None:
        self.model = model
        self.backend = backend
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len = max_model_len
        largest = self.batch_sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=model.device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=model.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a graph (tests and logs read it)

    def __getattr__(self, name: str):
        # Everything but forward (config, dtype, device, logits, ...) is the model's.
        return getattr(self.model, name)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.monotonic()
        self.backend.enable_decode_graphs(self.batch_sizes, self.max_model_len)
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so the smaller graphs fit in the memory pool the larger one left.
        for size in reversed(self.batch_sizes):
            meta = self.backend.capture_metadata(size)
            ids, positions = self.input_ids[:size], self.positions[:size]
            # Warm up off the capture: lazy initialisation (kernel modules, cuBLAS handles,
            # RoPE tables) must not happen inside it.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model.forward(ids, positions, self.backend, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model.forward(ids, positions, self.backend, meta)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs",
                 self.batch_sizes, time.monotonic() - started)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta,
                embeds=None):
        size = getattr(meta, "graph_batch_size", 0)
        if not size or embeds is not None:  # image embeddings come with prefills only
            return self.model.forward(input_ids, positions, backend, meta, embeds)
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.graphs[size].replay()
        self.replays += 1
        # A view of the graph's output, valid until the next replay; the runner gathers
        # the rows it samples from before then.
        return self.outputs[size][:n]
