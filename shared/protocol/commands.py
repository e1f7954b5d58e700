"""A frontend's operator commands to an engine, and the engine's answers."""

from __future__ import annotations

import msgspec


class LoraUpdateResult(msgspec.Struct, tag="lora_result", frozen=True):
    """An engine's answer to a LoraUpdate: status 200, or the HTTP status of the problem."""

    op_id: str
    status: int
    message: str = ""


class EngineCommand(msgspec.Struct, tag="engine_command", frozen=True):
    """From a frontend: an operator's command for the engine itself (TensorRT-LLM's and
    vLLM's /start_profile, /stop_profile, /energy_metrics; vLLM's /reset_prefix_cache); the
    engine answers with an `EngineCommandResult` carrying the same `op_id`."""

    op_id: str
    command: str  # "start_profile" | "stop_profile" | "read_energy" | "reset_prefix_cache"


class EnergyReading(msgspec.Struct, frozen=True):
    """One energy counter of the engine's machine: joules since the counter's own origin
    (a RAPL domain, or a GPU since its driver loaded), monotonic but for wrap-arounds."""

    source: str  # e.g. "rapl:package-0", "nvml:gpu-0"
    energy_j: float


class EngineCommandResult(msgspec.Struct, tag="command_result", frozen=True):
    """An engine's answer to an EngineCommand: status 200, or the HTTP status of the problem
    (404: the engine has nothing to do it with, 400 or 409: not now)."""

    op_id: str
    status: int
    message: str = ""
    energy: list[EnergyReading] = []  # read_energy's readings
    path: str = ""  # stop_profile: the trace file written
