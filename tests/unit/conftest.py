import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module: its models and tensors are tiny, so more
    threads only add overhead, and on a busy machine their spinning makes tests several
    times slower. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
