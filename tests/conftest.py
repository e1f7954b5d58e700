import os

import pytest
from xdist.scheduler import LoadScopeScheduling

# Under pytest-xdist (`make test`: one worker per core) every worker and the servers it starts
# share the cores with the other worker's: each worker's own torch (the in-process engine
# tests) takes its share of the cores, and libgomp's threads sleep rather than spin while
# they wait. Spinning threads on cores another process needs stalled steps for most of a
# second (docs/operations.md, OMP_WAIT_POLICY). Set before anything imports torch: libgomp
# reads it when it loads.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // XDIST_WORKERS))

from tests.memory_watch import MemoryWatch  # noqa: E402
from tests.servers import Cluster, Engine, Stack, engine_and_frontend  # noqa: E402

# One torch thread: on a 2-core machine the step's second thread waits on cores that the
# frontend, the test client and the session's other servers hold (measured under load there:
# a 32-token completion took 8.5 s with two threads, 1.1 s with one); the model is tiny.
SHARED_ENGINE_ARGS = ("--max-num-batched-tokens", "256", "--dtype", "float32", "--threads", "1")

# `make test` runs the suite on two pytest-xdist workers: a test file runs whole on one worker,
# so its module-scoped servers start once. Files that share a session server other than the
# shared engine (or transformers' load of the default model) run on one worker too, so each
# worker starts only the ones it uses. Every worker has its own shared engine: the files that
# use it are most of the suite.
XDIST_GROUPS = {
    "test_reference.py": "cluster", "test_two_frontends.py": "cluster",
    "test_vllm_metrics.py": "cluster", "test_weights.py": "cluster",
    "test_beam_search.py": "cluster",  # transformers' load of the default model, once
    "test_fuzz.py": "fuzz", "test_schemathesis.py": "fuzz",
}


class FileGroupScheduling(LoadScopeScheduling):
    """xdist's file scheduling, with XDIST_GROUPS' files as one unit each. (Its own
    `--dist loadgroup` marks do nothing under pytest 9: they rename items through an
    attribute pytest no longer reads.)"""

    @staticmethod
    def _split_scope(nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return XDIST_GROUPS.get(path.rsplit("/", 1)[-1], path)


@pytest.hookimpl(optionalhook=True)  # a plain `pytest -p no:xdist` has no such hook
def pytest_xdist_make_scheduler(config, log):
    return FileGroupScheduling(config, log)


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory):
    """The session's `sluice engine` on the default model, over tcp: `stack` and the tests
    whose flags are all the frontend's (`Engine.frontend`) put frontends on it rather than
    load the model again.

    A small step budget makes multi-chunk prefill happen with moderately long prompts.
    float32: many tests compare the answers of requests sent at once, which the engine may
    batch differently; in bfloat16 the logits are 1/8 apart near 20, so another batch's
    summation order can swap two near-tied tokens; and the reference test compares with
    transformers' float32 greedy tokens.

    `stack`'s frontend starts with it, its imports overlapping the model's load rather than
    following it (seconds a session, issue 29); most of the suite uses it.
    """
    e, default = engine_and_frontend(str(tmp_path_factory.mktemp("engine")), SHARED_ENGINE_ARGS,
                                     "frontend", "--export-engine-metrics")
    e.default_frontend = default
    yield e
    default.stop()
    e.stop()


@pytest.fixture(scope="session")
def stack(shared_engine):
    """The session's default server: a frontend over the shared engine that exports the
    engine's series on its /metrics, as `sluice serve`'s frontend does."""
    return shared_engine.default_frontend


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """`sluice engine` + two `sluice frontend`s over tcp, as an orchestrator runs them, with
    the shared engine's settings but an engine of its own: the reference test compares greedy
    tokens with transformers' and has only been checked on a prefix cache that holds nothing
    but its own prompts' pages."""
    tmp = str(tmp_path_factory.mktemp("cluster"))
    engine = Engine(tmp, *SHARED_ENGINE_ARGS)
    try:
        c = Cluster(engine, tmp)
    except Exception:
        engine.stop()
        raise
    yield c
    c.stop()
    engine.stop()


@pytest.fixture(scope="session")
def base_url(stack):
    return stack.base_url


@pytest.fixture(scope="session")
def edge_url(shared_engine, tmp_path_factory):
    """A frontend over the shared engine with the hermes tool-call parser and the qwen3
    reasoning parser, and room for only 3 stored responses: the Responses and Anthropic
    Messages tests share it. Its flags are all the frontend's, so it loads no model (an
    engine start is the suite's dearest setup); it exports the engine's series, as `serve`'s
    frontend does."""
    s = shared_engine.frontend(str(tmp_path_factory.mktemp("edge")), "edge",
                               "--export-engine-metrics", "--tool-call-parser", "hermes",
                               "--reasoning-parser", "qwen3", "--max-stored-responses", "3")
    yield s.base_url
    s.stop()


@pytest.fixture(scope="session")
def fuzz_stack(tmp_path_factory):
    """`sluice serve` as the fuzzers attack it (fuzz_checks.STACK_ARGS: postproc workers, a
    short context, a request timeout), shared by test_fuzz and test_schemathesis: each checks
    afterwards that none of its processes died and that it is idle again. `pids`: the
    processes `serve` started."""
    from tests import fuzz_checks

    s = Stack(str(tmp_path_factory.mktemp("fuzz")), *fuzz_checks.STACK_ARGS)
    s.pids = fuzz_checks.children(s.proc.popen.pid)
    yield s
    s.stop()



def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.memory_watch = MemoryWatch()


def pytest_terminal_summary(terminalreporter, config):
    watch = getattr(config, "memory_watch", None)
    if watch is not None and (line := watch.summary()):
        terminalreporter.write_line(line)
