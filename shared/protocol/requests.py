"""Frontend -> engine: requests, aborts, LoRA updates and pings."""

from __future__ import annotations

import msgspec
import numpy as np

from shared.protocol.params import OutputParams, SamplingParams, TokenIds

# Element types a RawTensor may carry, with their sizes (numpy has no bfloat16).
TENSOR_DTYPES = {"float32": 4, "float16": 2, "bool": 1}


class RawTensor(msgspec.Struct, frozen=True, array_like=True):
    """An array as raw little-endian bytes with its shape and dtype: never pickled (a peer's
    pickle could run code) and never a JSON-style list (megabytes of floats). Receivers
    check it with `unpack_tensor` before use."""

    data: bytes
    shape: list[int]
    dtype: str  # a TENSOR_DTYPES key


def pack_tensor(array: np.ndarray) -> RawTensor:
    array = np.ascontiguousarray(array)
    dtype = "bool" if array.dtype == np.bool_ else array.dtype.name
    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"cannot send a {dtype} tensor")
    return RawTensor(array.astype(array.dtype.newbyteorder("<")).tobytes(), list(array.shape),
                     dtype)


def unpack_tensor(tensor: RawTensor) -> np.ndarray:
    """The array a RawTensor holds; ValueError when dtype, shape and byte count disagree."""
    size = TENSOR_DTYPES.get(tensor.dtype)
    if size is None:
        raise ValueError(f"tensor dtype must be one of {sorted(TENSOR_DTYPES)}")
    if not tensor.shape or any(d < 1 for d in tensor.shape):
        raise ValueError("tensor dimensions must be positive")
    count = 1
    for d in tensor.shape:
        count *= d
    if count * size != len(tensor.data):
        raise ValueError(f"tensor of shape {tensor.shape} and dtype {tensor.dtype} needs "
                         f"{count * size} bytes, not {len(tensor.data)}")
    kind = np.bool_ if tensor.dtype == "bool" else np.dtype(tensor.dtype).newbyteorder("<")
    return np.frombuffer(tensor.data, dtype=kind).reshape(tensor.shape)


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a prompt, as the model's image processor left it (Idefics3: the tiles
    and the global view), and where its placeholder tokens sit in the prompt: the span
    [offset, offset + length) from its first to its last token, whose image-token
    positions take the vision encoder's outputs in order."""

    pixel_values: RawTensor  # [patches, channels, height, width]
    pixel_attention_mask: RawTensor  # [patches, height, width] bool: real pixels
    offset: int
    length: int


class Continuation(msgspec.Struct, frozen=True):
    """A request moved to this engine mid-stream (its engine died, froze or drained): what it
    had generated so far, which the client already has. The engine prefills prompt + these
    and goes on with the next token as if it had drawn them itself (usage, max_tokens,
    penalties, stops and a seeded draw at each position all count them); whoever
    post-processes it first replays them as the frames the client got (`frame_sizes`
    tokens each), so the text goes on where it stopped and frame numbers line up."""

    output_token_ids: TokenIds
    frame_sizes: list[int]  # tokens per frame already delivered; they sum to the ids' count
    cumulative_logprob: float = 0.0


class PoolingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pooling request (vLLM's --runner pooling): prefill only, and the pooled hidden state
    comes back instead of tokens. How the states are pooled is the model's (engine.step.pooler)."""

    # embed: the pooled hidden state; a cross-encoder's classify or score: the sigmoid of
    # its one logit, else the softmax over its labels (vLLM's).
    task: str = "embed"
    normalize: bool | None = None  # None: as the model's pooler config says
    dimensions: int | None = None  # Matryoshka: keep the first n, then normalize
    # An encoder's segment of each prompt token (int32, as TokenIds); empty: all 0. A
    # query-document pair's second segment is 1 for BERT cross-encoders.
    token_type_ids: bytes = b""


class TraceContext(msgspec.Struct, frozen=True, array_like=True):
    """W3C trace context as its two headers (shared.trace_context reads them): the span
    a request's work in the next process is the child of."""

    traceparent: str
    tracestate: str = ""


class EngineRequest(msgspec.Struct, tag="request", frozen=True):
    request_id: str
    prompt_token_ids: TokenIds
    params: SamplingParams
    # Where frames for this request go: the frontend's result socket. The engine (or the
    # postproc worker it assigns) connects there lazily and pushes.
    reply_to: str
    arrival_time: float
    # What a postproc worker needs to turn tokens into text for this request.
    output: OutputParams = OutputParams()
    # Passed through untouched (req P-12): the salt joins the root of the request's
    # prefix-cache hash chain, so tenants with different salts never share cached pages;
    # priority orders the waiting queue under a priority scheduler (lower runs first, as vLLM).
    cache_salt: str | None = None
    priority: int = 0
    # A multimodal prompt's images, in prompt order (req T-13); the engine checks them.
    images: list[ImageInput] = []
    # Set when the request continues a stream another engine started (frontend migration).
    continuation: Continuation | None = None
    # Set for a pooling request (an embedding); a pooling engine takes nothing else.
    pooling: PoolingParams | None = None
    # The LoRA adapter to run it with, by name (the request's `model`); None: the base model.
    lora_name: str | None = None
    # Set when the frontend traces it: the engine's and the postproc worker's spans join it.
    trace_context: TraceContext | None = None
    # TensorRT-LLM's scheduling_params.priority_tier (0-15): under the priority scheduler a
    # higher tier runs before every lower one, `priority` ordering within a tier.
    priority_tier: int = 0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    """From a frontend (the client left) or a postproc worker (a stop string matched)."""

    request_ids: list[str]


class LoraAdapterInfo(msgspec.Struct, frozen=True):
    """A LoRA adapter an engine serves: its name (what requests send as `model`), its PEFT
    folder and, optionally, the model it was trained on (vLLM's base_model_name)."""

    name: str
    path: str
    base_model_name: str | None = None


class LoraUpdate(msgspec.Struct, tag="lora_update", frozen=True):
    """From a frontend: load (`path` set) or unload an adapter at run time; the engine
    answers with a `LoraUpdateResult` carrying the same `op_id`."""

    op_id: str
    action: str  # "load" | "unload"
    name: str
    path: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Heartbeat from a frontend; the engine answers with `EngineStats`."""

    sender_id: str
    sent_at: float
