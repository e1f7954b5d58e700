import shutil

import pytest
import torch

from engine.kernels.cpu_kernels import ISA_MARCH, cpu_flags, cpu_runs, kernels_for


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module: its models and tensors are tiny, so more
    threads only add overhead, and on a busy machine their spinning makes tests several
    times slower. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(ISA_MARCH))
def compiled(request):
    """The engine's compiled CPU kernels (engine/kernels/csrc), once per build: `native` (the CPU's
    own ISA: AVX-512 paths where it has them) and `avx2` (x86-64-v3, what an AVX2-only CPU
    runs), so every machine tests both paths it can run. Skips an ISA this CPU lacks, `avx2`
    where native is the AVX2 path already, and both where no compiler is."""
    isa = request.param
    if not cpu_runs(isa):
        pytest.skip(f"this CPU cannot run the {isa} build (it lacks {isa}'s instructions)")
    if isa == "avx2" and "avx512f" not in cpu_flags():
        # Without AVX-512 the native build takes the same AVX2 paths (the source picks them
        # by __AVX512F__): a second build would only run every test twice.
        pytest.skip("no AVX-512 here: the native build is the AVX2 path, tested as native")
    module = kernels_for(isa)
    if module is None:
        # Where a compiler exists (this project's machines and CI) they must build.
        assert shutil.which("c++") is None, "a C++ compiler is here but the kernels failed"
        pytest.skip("no C++ compiler: the engine runs plain torch ops")
    return module
