"""Which Python packages travel to the device as wheels, and the check that they suffice.

The device (docs of the device tool, KINDS.md: Python 3.12, torch 2.11 cu130, transformers
5.17) has a long list of packages and none of CARRIED. Each carried package is pinned to the
version this repository is tested with here; one wheel each (pip refuses two versions of one
package in one install). Standard library only: runs on the device before the install.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

PYTHON_VERSION = "3.12"  # the device's python3
# The device's manylinux tags (glibc 2.39 there): pip matches each N exactly, so all go.
PLATFORMS = ["manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)]

CARRIED = {
    "msgspec": "0.23.0",
    "pyzmq": "27.3.0",
    "starlette": "1.10.0",
    "uvicorn": "0.55.0",
    "httptools": "0.9.0",  # uvicorn[standard]'s HTTP parser, which the frontend asks for
    "llguidance": "1.9.1",
    "gguf": "0.19.0",
    "flashinfer-python": "0.6.14",  # pyproject.toml's `cuda` extra
    # FlashInfer's runtime; the kernels built ahead (kernels.py) link against this release.
    "apache-tvm-ffi": "0.1.15.post2",
    "redis": "8.1.0",  # --state-store redis://'s client (frontend.state.store)
    "python-multipart": "0.0.34",  # /v1/files uploads (Starlette's form parser)
    # --tokenizer-mode mistral (shared.mistral_tokenizer), with what it needs the device lacks.
    "mistral-common": "1.13.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "pydantic-extra-types": "2.11.1",
    "pycountry": "26.2.16",  # pydantic-extra-types[pycountry], which mistral-common asks for
    "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1",
    "referencing": "0.37.0",
    "rpds-py": "2026.9.1",
    # --otlp-traces-endpoint (shared.tracing): the SDK, its OTLP exporters and what they need
    # beyond the device's grpcio, protobuf and requests.
    "opentelemetry-api": "1.45.2",
    "opentelemetry-sdk": "1.45.2",
    "opentelemetry-semantic-conventions": "0.66b2",
    "opentelemetry-proto": "1.45.2",
    "opentelemetry-exporter-otlp-proto-common": "1.45.2",
    "opentelemetry-exporter-otlp-common": "0.66b2",
    "opentelemetry-exporter-http-transport": "0.66b2",
    "opentelemetry-exporter-otlp-proto-grpc": "1.45.2",
    "opentelemetry-exporter-otlp-proto-http": "1.45.2",
    "googleapis-common-protos": "1.76.0",
}

# On the device already, as KINDS.md lists them (read 2026-11-17); names normalized.
DEVICE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())

# Declared but never imported on sluice's path: flashinfer-python's cuDNN, CuTe-DSL and
# cuTile backends (the engine uses its attention wrappers, norm, RoPE, activation and
# sampling), and uvicorn[standard]'s WebSockets, --reload and env-file support (the
# frontend asks for its uvloop loop and httptools parser only).
UNUSED_REQUIREMENTS = frozenset({"cuda-tile", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
                                 "websockets", "watchfiles", "python-dotenv"})

# The device's interpreter, for environment markers (`; sys_platform != 'win32'`).
DEVICE_MARKERS = {
    "python_version": PYTHON_VERSION, "python_full_version": "3.12.3",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "os_name": "posix",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalized
    version: str


def read_wheels(folder: Path) -> list[Wheel]:
    out = []
    for path in sorted(folder.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        out.append(Wheel(path, normalize(name), version))
    return out


def needs_on_device(specs: list[str], extras: frozenset[str] = frozenset()) -> set[str]:
    """The packages these requirement strings name for the device's Python 3.12 with the
    given extras requested (markers evaluated as there), normalized, extras dropped."""
    from packaging.requirements import Requirement  # only here, never on the device

    needs = set()
    for spec in specs:
        requirement = Requirement(spec)
        marker = requirement.marker
        if marker is None or any(marker.evaluate(DEVICE_MARKERS | {"extra": extra})
                                 for extra in extras | {""}):
            needs.add(normalize(requirement.name))
    return needs


def requirements(wheel: Path, extras: frozenset[str] = frozenset()) -> set[str]:
    """What a wheel needs on the device, with `extras` of it requested."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode()
    specs = [line.removeprefix("Requires-Dist:").strip() for line in text.splitlines()
             if line.startswith("Requires-Dist:")]
    return needs_on_device(specs, extras)


def project_requirements(pyproject: Path) -> dict[str, frozenset[str]]:
    """sluice's own runtime dependencies and its `cuda` extra: each package, normalized,
    with the extras asked of it (uvicorn[standard])."""
    import tomllib  # 3.11+: both here and on the device

    from packaging.requirements import Requirement

    project = tomllib.loads(pyproject.read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["cuda"]
    return {normalize(r.name): frozenset(r.extras) for r in map(Requirement, specs)}


def problems(folder: Path, pyproject: Path) -> list[str]:
    """Why the wheels in `folder` would not give the device what sluice needs; [] when they
    do: one wheel per carried package, at its pinned version, and every need of sluice and
    of each wheel either on the device or carried."""
    wheels = read_wheels(folder)
    found: dict[str, list[str]] = {}
    for wheel in wheels:
        found.setdefault(wheel.name, []).append(wheel.version)
    issues = []
    for name, version in CARRIED.items():
        versions = found.get(normalize(name), [])
        if versions != [version]:
            issues.append(f"{name}: want one wheel of {version}, found {versions or 'none'}")
    for name in sorted(set(found) - {normalize(n) for n in CARRIED}):
        issues.append(f"{name}: a wheel that is not in CARRIED")
    available = DEVICE_HAS | set(found)
    ours = project_requirements(pyproject)
    needs = {(need, "sluice") for need in ours}
    needs |= {(need, f"{w.name}[{','.join(sorted(ours.get(w.name, ())))}]".removesuffix("[]"))
              for w in wheels for need in requirements(w.path, ours.get(w.name, frozenset()))}
    for need, of in sorted(needs):
        if need not in available and need not in UNUSED_REQUIREMENTS:
            issues.append(f"{need} (needed by {of}) is neither on the device nor carried")
    return issues


def imports_not_on_device(repo: Path) -> list[str]:
    """Third-party modules sluice's code imports (anywhere, lazily too) whose package, as
    this machine's installs map modules to packages, is neither on the device nor
    carried."""
    import ast
    import importlib.metadata
    import sys

    modules = set()
    for package in ("engine", "frontend", "postproc", "shared"):
        for source in (repo / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    ours = {"engine", "frontend", "postproc", "shared"}
    packages = importlib.metadata.packages_distributions()
    available = DEVICE_HAS | {normalize(n) for n in CARRIED}
    return [f"module {module} ({', '.join(packages.get(module, [])) or 'no package here'})"
            " is neither on the device nor carried"
            for module in sorted(modules - ours - set(sys.stdlib_module_names))
            if not any(normalize(p) in available for p in packages.get(module, []))]


def download_command(python: str, dest: Path) -> list[str]:
    """`pip download` of exactly CARRIED for the device's Python and platform."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
            "--dest", str(dest), *(f"{n}=={v}" for n, v in CARRIED.items())]
