"""The torch profiler behind the frontends' /start_profile and /stop_profile (TensorRT-LLM's
and vLLM's routes), writing a trace where the operator said (--profile-dir, or vLLM's
VLLM_TORCH_PROFILER_DIR).

It runs on the engine's main thread, the one that steps the model (the server hands it the
commands through its inbox), so the trace holds the steps' own operators. A stop writes one
Chrome trace JSON file (chrome://tracing, Perfetto and TensorBoard's profiler open it) named
after the engine and the time, and answers with its path.
"""

from __future__ import annotations

import logging
import os
import re
import time

from shared.startup_checks import StartupError

log = logging.getLogger("sluice.engine")

PROFILE_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"  # vLLM's name, read as --profile-dir's default


class ProfileError(Exception):
    """A profile command that cannot be done: `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class EngineProfiler:
    def __init__(self, directory: str | None, engine_id: str) -> None:
        """`directory`: where traces go (made now, so a bad one stops the engine at start);
        None: profiling is off and the commands answer 404."""
        self.directory = directory
        self.engine_id = engine_id
        self._profile = None  # the running torch.profiler.profile
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise StartupError(f"--profile-dir {directory}: {exc.strerror}; name a "
                                   "folder the engine may write") from None

    def start(self) -> None:
        self._check_enabled()
        if self._profile is not None:
            raise ProfileError(400, "the profiler is already running; POST /stop_profile "
                                    "first")
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.start()
        self._profile = profile
        log.info("profiler started; /stop_profile writes its trace to %s", self.directory)

    def stop(self) -> str:
        """Stops the profiler and writes its trace; the trace file's path."""
        self._check_enabled()
        if self._profile is None:
            raise ProfileError(400, "the profiler is not running; POST /start_profile first")
        profile, self._profile = self._profile, None
        profile.stop()
        path = os.path.join(self.directory, self._file_name())
        try:
            profile.export_chrome_trace(path)
        except OSError as exc:
            raise ProfileError(500, f"could not write the trace to {path}: "
                                    f"{exc.strerror}") from None
        log.info("profiler stopped; trace written to %s", path)
        return path

    def _check_enabled(self) -> None:
        if self.directory is None:
            raise ProfileError(404, "profiling is off: start the engine with --profile-dir "
                                    f"DIR (or {PROFILE_DIR_ENV}=DIR)")

    def _file_name(self) -> str:
        # The engine id holds an address (host@tcp://...): only safe characters in a name.
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.engine_id).strip("_") or "engine"
        return f"{name}.{time.strftime('%Y%m%d-%H%M%S')}.{time.time_ns() % 10**9:09d}" \
               ".pt.trace.json"
