"""Wire protocol between frontends, the engine and postproc workers.

Every message is a tagged msgspec Struct so one socket can carry several kinds; the codec in
`shared.codec` encodes them with msgpack. Token ids travel as raw little-endian int32 buffers
(`TokenIds`), never as lists of Python ints, because a long prompt as a list costs far more to
encode and decode than the model step it feeds.
"""

# The wire's Structs by message family, each in its module: `params` (what a request asks
# for), `requests` (frontend -> engine), `engine_outputs` (engine -> frontend), `postproc`
# (engine <-> postproc worker -> frontend), `commands` (an operator's commands to an
# engine). Every tier imports them from here.
from shared.protocol.commands import (  # noqa: F401
    EnergyReading,
    EngineCommand,
    EngineCommandResult,
    LoraUpdateResult,
)
from shared.protocol.engine_outputs import (  # noqa: F401
    EngineStats,
    HistogramCounts,
    OutputBatch,
    RequestOutput,
)
from shared.protocol.params import (  # noqa: F401
    GREEDY_TEMPERATURE,
    ChunkFormat,
    Constraint,
    OutputParams,
    SamplingParams,
    ThinkingBudget,
    TokenIds,
    TokenLogprobs,
    pack_ids,
    unpack_ids,
)
from shared.protocol.postproc import (  # noqa: F401
    FrameBatch,
    FunctionCallDelta,
    LogprobEntry,
    TextFrame,
    ToolCallDelta,
    TopLogprob,
    WorkBatch,
    WorkerDone,
    WorkerHeartbeat,
)
from shared.protocol.requests import (  # noqa: F401
    TENSOR_DTYPES,
    AbortRequest,
    Continuation,
    EngineRequest,
    ImageInput,
    LoraAdapterInfo,
    LoraUpdate,
    Ping,
    PoolingParams,
    RawTensor,
    TraceContext,
    pack_tensor,
    unpack_tensor,
)

EngineInbound = EngineRequest | AbortRequest | Ping | LoraUpdate | EngineCommand
FrontendInbound = OutputBatch | FrameBatch | EngineStats | LoraUpdateResult | EngineCommandResult
WorkerInbound = WorkBatch
EngineFromWorker = WorkerHeartbeat | WorkerDone | AbortRequest
