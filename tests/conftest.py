import pytest

from tests.servers import Stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """One full stack (engine + frontend) on the default model, shared by a test session.

    A small step budget makes multi-chunk prefill happen with moderately long prompts.
    float32: many tests compare the answers of requests sent at once, which the engine may
    batch differently; in bfloat16 the logits are 1/8 apart near 20, so another batch's
    summation order can swap two near-tied tokens. (`edge_url` runs the bf16 default.)
    """
    s = Stack(str(tmp_path_factory.mktemp("stack")), "--max-num-batched-tokens", "256",
              "--dtype", "float32")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def base_url(stack):
    return stack.base_url


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """`sluice engine` + two `sluice frontend`s over tcp (step budget 256: chunked prefill)."""
    from tests.servers import Cluster

    # float32: the reference test compares with transformers' float32 greedy tokens.
    c = Cluster(str(tmp_path_factory.mktemp("cluster")), "--max-num-batched-tokens", "256",
                "--dtype", "float32")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def edge_url(tmp_path_factory):
    """`sluice serve` with the hermes tool-call parser and the qwen3 reasoning parser, and
    room for only 3 stored responses: the Responses and Anthropic Messages tests share it."""
    s = Stack(str(tmp_path_factory.mktemp("edge")), "--tool-call-parser", "hermes",
              "--reasoning-parser", "qwen3", "--max-stored-responses", "3")
    yield s.base_url
    s.stop()
