import shutil

import pytest
import torch

from engine.cpu_kernels import kernels


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module: its models and tensors are tiny, so more
    threads only add overhead, and on a busy machine their spinning makes tests several
    times slower. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compiled():
    """The engine's compiled CPU kernels (engine/csrc); the test skips where no compiler is."""
    module = kernels()
    if module is None:
        # Where a compiler exists (this project's machines and CI) they must build.
        assert shutil.which("c++") is None, "a C++ compiler is here but the kernels failed"
        pytest.skip("no C++ compiler: the engine runs plain torch ops")
    return module
