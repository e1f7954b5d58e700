"""FlashInfer's kernels for the default model on an H200, compiled ahead of time here.

FlashInfer compiles each kernel module just in time on first use (minutes each on the
device's clock, which the check cannot spare). Its own prebuilt modules come as the
`flashinfer_jit_cache` package: when that imports, FlashInfer loads
`get_jit_cache_dir()/<module>/<module>.so` instead of compiling. This builds exactly the
modules the engine loads for the default model's shape (head dim 64, bfloat16 q/kv/out,
int32 page tables) for sm_90a, with the nvcc here, and writes them as such a package:

  batch prefill, fa2    the prefill wrapper (the backend asks for fa2: ATTENTION_KERNELS in
                        engine/attention/flashinfer_backend.py) and the tensor-core decode
                        path (the batch-invariant mode), which runs the same module
  batch decode          the CUDA-core decode kernel (query groups up to 4: the default
                        model's is 3)
  norm, rope, silu_and_mul, sampling

    python -m benchmarks.gpukit.kernels DEST     (benchmarks/gpu_check.sh --prepare runs it)
    python -m benchmarks.gpukit.kernels --missing  (what FlashInfer would not find built)

The modules link against CUDA's runtime and the driver by soname, and against FlashInfer's
tvm-ffi runtime: the carried apache-tvm-ffi must be the release they were built with
(wheels.CARRIED). Where this machine's CUDA lacks them, two things are supplied: a libcuda.so
stub with the driver's soname for the link (the device's driver is found by that soname),
and cuBLAS's and cuRAND's headers (norm and sampling include them), taken from NVIDIA's
wheels, which pip downloads once (about 500 MB) into BUILD_DIR.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from benchmarks.gpukit.model import SHAPE

ARCH = "9.0a"  # Hopper's own instructions (wgmma); the H100 and H200
HEAD_DIM = SHAPE["head_dim"]  # the default model's (SmolLM2-135M): 64
PACKAGE = "flashinfer_jit_cache"
# FlashInfer's workspace for the build: objects stay there, so a rebuild compiles only what
# changed (ninja compares the commands, so the same FlashInfer install and CUDA location).
BUILD_DIR = Path(os.environ.get("GPUKIT_BUILD_DIR")
                 or Path(tempfile.gettempdir()) / "sluice-gpukit-flashinfer")

SHIM = '''"""sluice's FlashInfer kernels for sm_90a, built ahead (benchmarks/gpukit/kernels.py);
FlashInfer loads <get_jit_cache_dir()>/<module>/<module>.so instead of compiling it."""

import os

__version__ = "{version}+sluice.sm90a"  # FlashInfer checks the prefix against its own


def get_jit_cache_dir() -> str:
    return os.path.join(os.path.dirname(__file__), "jit_cache")
'''


def specs():
    """FlashInfer's JitSpecs of the modules the engine loads for the default shape."""
    import torch
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.sampling import gen_sampling_module

    bf16, i32, no_rope = torch.bfloat16, torch.int32, 0
    return [
        # (backend, q, kv, out, index, head dims, positional encoding, sliding window,
        #  logits soft cap, fp16 qk reduction): what the wrappers' plan() asks for.
        gen_batch_prefill_module("fa2", bf16, bf16, bf16, i32, HEAD_DIM, HEAD_DIM, no_rope,
                                 False, False, False),
        gen_batch_decode_module(bf16, bf16, bf16, i32, HEAD_DIM, HEAD_DIM, no_rope, False,
                                False),
        gen_norm_module(),
        gen_rope_module(),
        gen_act_and_mul_module("silu"),
        gen_sampling_module(),
    ]


def missing(package_root: Path) -> list[str]:
    """The modules FlashInfer would not load prebuilt from the package under package_root
    ([] when it loads all): asked of FlashInfer itself, in a fresh interpreter with the
    package on its path and set for the target (its generators refuse to run where no GPU
    of sm75+ is seen and no arch is named)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")])
        env = os.environ | {"FLASHINFER_CUDA_ARCH_LIST": ARCH, "PYTHONPATH": path,
                            "FLASHINFER_WORKSPACE_BASE": scratch}
        listed = subprocess.run([sys.executable, "-m", "benchmarks.gpukit.kernels",
                                 "--missing"], env=env, capture_output=True, text=True)
    if listed.returncode != 0:
        return [f"(FlashInfer could not be asked: {listed.stderr.strip()[-500:]})"]
    return listed.stdout.split()


# Headers some modules include that a bare CUDA toolkit may lack, and the wheels with them.
HEADER_WHEELS = {"cublasLt.h": "nvidia-cublas==13.0.2.14",
                 "curand_kernel.h": "nvidia-curand==10.4.5.25"}


def _library_headers(folder: Path) -> list[str]:
    """Include folders for HEADER_WHEELS' headers that CUDA's own include folder lacks."""
    cuda_includes = [Path(home) / "include" for home in
                     (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda") if home]
    wanted = [spec for header, spec in HEADER_WHEELS.items()
              if not any((inc / header).is_file() for inc in cuda_includes)]
    include = folder / "nvidia" / "cu13" / "include"
    for spec in wanted:
        header = next(h for h, s in HEADER_WHEELS.items() if s == spec)
        if (include / header).is_file():
            continue
        with tempfile.TemporaryDirectory() as download:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary=:all:", "--dest", download, spec], check=True)
            for wheel in Path(download).glob("*.whl"):
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(folder, [n for n in archive.namelist()
                                                if n.startswith("nvidia/cu13/include/")])
    return [str(include)] if wanted else []


def _driver_stub(folder: Path) -> Path:
    """A libcuda.so with the driver's soname and no code, for linking where no driver is."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "libcuda.so"
    if not stub.exists():
        source = folder / "empty.c"
        source.write_text("")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub),
                        str(source)], check=True)
    return folder


def _cuda_library_dirs() -> list[str]:
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    return [os.path.join(home, sub) for home in homes if home
            for sub in ("lib64", "lib", "targets/x86_64-linux/lib")
            if os.path.isdir(os.path.join(home, sub))]


def build(dest: Path) -> None:
    """Compile the modules (reusing BUILD_DIR's objects) and write the package under dest.
    FlashInfer reads its build settings at import, so this sets them first."""
    if shutil.which("nvcc") is None:
        raise SystemExit("nvcc is not on PATH: the kernels cannot be built here")
    os.environ.update(
        FLASHINFER_CUDA_ARCH_LIST=ARCH,
        FLASHINFER_WORKSPACE_BASE=str(BUILD_DIR),
        # FlashInfer links with -lcudart -lcuda from its idea of CUDA's home; name the
        # runtime's real folders and the driver stub to the linker too.
        LIBRARY_PATH=os.pathsep.join(
            _cuda_library_dirs() + [str(_driver_stub(BUILD_DIR / "stubs"))]
            + [os.environ.get("LIBRARY_PATH", "")]),
        # nvcc and the host compiler search CPATH after the command's own include folders.
        CPATH=os.pathsep.join(_library_headers(BUILD_DIR / "headers")
                              + [os.environ.get("CPATH", "")]),
    )
    import flashinfer
    from flashinfer.jit import env as jit_env

    jit_cache = dest / PACKAGE / "jit_cache"
    shutil.rmtree(dest / PACKAGE, ignore_errors=True)
    jit_cache.mkdir(parents=True)
    (dest / PACKAGE / "__init__.py").write_text(SHIM.format(version=flashinfer.__version__))
    for spec in specs():
        print(f"building {spec.name}", flush=True)
        spec.build(verbose=False)
        built = jit_env.FLASHINFER_JIT_DIR / spec.name / f"{spec.name}.so"
        (jit_cache / spec.name).mkdir()
        shutil.copy2(built, jit_cache / spec.name / built.name)
    print(f"{len(specs())} modules in {dest / PACKAGE}")


if __name__ == "__main__":
    if sys.argv[1] == "--missing":  # missing()'s question, asked in this interpreter
        print("\n".join(spec.name for spec in specs() if not spec.is_aot))
    else:
        build(Path(sys.argv[1]).resolve())
