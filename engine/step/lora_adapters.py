"""LoRA adapters in the engine: PEFT checkpoints read and checked against the model, the
adapters an engine knows by name, and which of them requests use.

A PEFT folder holds `adapter_config.json` and `adapter_model.safetensors`. Reading one checks
everything a step would otherwise trip over (a missing file, a rank above --max-lora-rank,
a module this model lacks, a tensor of the wrong shape) and raises `LoraError` naming it:
the engine answers the request or the load with that, and never dies of an adapter.

Each loaded adapter gets an id that is never reused: the model's `LoraOps` keys its products
by it, and the prefix cache salts page hashes with it, so two adapters (or an adapter and
the one loaded later under its name) never share a cached page. An adapter unloaded while
requests use it stays installed until the last of them finishes.

Under tensor parallelism each rank holds its slice of every adapter, cut like the base
weight it adds to (vLLM's layout): on the column-parallel q/k/v and gate/up, A whole and B's
output rows split; on the row-parallel o_proj and down_proj, A's input columns split and B
whole, so the low-rank product is a partial sum like the base matmul's and joins its
all-reduce. Rank 0's manager decides (names, ids, which request uses which) and sends each
load and removal as a `LoraChange` to the other ranks (`peers`: engine.parallel.leader),
each reading its slice from the same folder (`apply`): the folder must be readable on every
machine, as the model's is. A rank that cannot read it fails the load, naming the rank.
"""

from __future__ import annotations

import logging
import math
import os
import re

import msgspec
import torch
from safetensors import safe_open

from engine.layers.lora_ops import TARGETS, LinearSite, LoraOps, LowRank, fuse, linear_sites
from engine.layers.sharding import Shard
from shared.protocol import LoraAdapterInfo

log = logging.getLogger("sluice.engine")


class LoraError(ValueError):
    """An adapter that cannot be loaded or used; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class PeftConfig(msgspec.Struct):
    """The adapter_config.json keys read here (others are ignored)."""

    r: int
    lora_alpha: float = 8.0
    use_rslora: bool = False
    target_modules: list[str] | str | None = None
    peft_type: str = "LORA"
    bias: str = "none"
    use_dora: bool = False
    fan_in_fan_out: bool = False
    alpha_pattern: dict[str, float] = {}
    modules_to_save: list[str] | None = None
    base_model_name_or_path: str | None = None


_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoraChange(msgspec.Struct, array_like=True):
    """An adapter installed (its folder) or removed (path ""), for the other ranks."""

    adapter_id: int
    path: str = ""


def read_peft_config(path: str) -> PeftConfig:
    config_path = os.path.join(path, CONFIG_FILE)
    # 404 as vLLM answers a path without an adapter ("No adapter found").
    if not os.path.isdir(path):
        raise LoraError(f"No adapter found at {path!r}: not a folder", 404)
    if not os.path.isfile(config_path):
        raise LoraError(f"No adapter found at {path!r}: the folder has no {CONFIG_FILE}", 404)
    try:
        with open(config_path, "rb") as f:
            config = msgspec.json.decode(f.read(), type=PeftConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LoraError(f"{config_path} is not a PEFT LoRA config: {exc}") from None
    unsupported = [
        (config.peft_type.upper() != "LORA", f"peft_type {config.peft_type!r} (only LORA)"),
        (config.bias != "none", f"bias {config.bias!r} (only 'none')"),
        (config.use_dora, "use_dora (DoRA)"),
        (config.fan_in_fan_out, "fan_in_fan_out"),
        (bool(config.alpha_pattern), "alpha_pattern"),
        (bool(config.modules_to_save), f"modules_to_save {config.modules_to_save}"),
        (config.r < 1, f"r={config.r}"),
        (not math.isfinite(config.lora_alpha), f"lora_alpha={config.lora_alpha}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise LoraError(f"adapter {path!r}: {what} is not supported")
    return config


def read_adapter(path: str, sites: dict[tuple[int, str], LinearSite], max_rank: int,
                 dtype: torch.dtype, device: torch.device, shard: Shard | None = None,
                 rank_sites: dict[tuple[int, str], LinearSite] | None = None
                 ) -> dict[int, LowRank]:
    """A PEFT LoRA folder as low-rank products by weight id, checked against the model's
    `sites` (the whole model's). With a shard, each product is this rank's slice, fused
    over `rank_sites` (the rank's own linears). Raises LoraError."""
    config = read_peft_config(path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise LoraError(f"the adapter folder {path!r} has no {WEIGHTS_FILE}")
    pairs = _read_pairs(path, weights_path)
    by_site: dict[tuple[int, str], dict] = {}
    for (layer, module), ab in sorted(pairs.items()):
        site_key, part, site = _site_of(path, layer, module, sites)
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoraError(f"adapter {path!r}: layer {layer} {module} lacks lora_"
                            f"{'A' if a is None else 'B'}")
        rank = a.shape[0]
        if rank > max_rank:
            raise LoraError(f"adapter {path!r} has rank {rank} ({module}), above "
                            f"--max-lora-rank {max_rank}")
        out = sum(site.parts) if part is None else site.parts[part]
        if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != site.in_features
                or tuple(b.shape) != (out, rank)):
            raise LoraError(f"adapter {path!r}: layer {layer} {module} has A {tuple(a.shape)} "
                            f"and B {tuple(b.shape)}; this model needs A (r, "
                            f"{site.in_features}) and B ({out}, r)")
        scaling = config.lora_alpha / (math.sqrt(rank) if config.use_rslora else rank)
        if shard is not None:
            a, b = _slice(shard, layer, module, site_key[1], a, b)
        by_site.setdefault(site_key, {})[part] = (a, b, scaling)
    local = sites if rank_sites is None else rank_sites
    return {local[key].weight_id: fuse(local[key], parts, dtype, device)
            for key, parts in by_site.items()}


def _read_pairs(path: str, weights_path: str) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The adapter file's tensors as (layer, module) -> {"A": ..., "B": ...}."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                found = _KEY.search(key)
                if found is None:
                    raise LoraError(f"adapter {path!r}: tensor {key!r} is not a LoRA A/B "
                                    f"weight of a decoder layer's linear")
                layer, module, which = int(found[1]), found[2], found[3]
                pairs.setdefault((layer, module), {})[which] = f.get_tensor(key)
    except LoraError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise LoraError(f"adapter {path!r}: cannot read {WEIGHTS_FILE}: {exc}") from None
    if not pairs:
        raise LoraError(f"adapter {path!r} holds no LoRA weights")
    return pairs


_ROW_PARALLEL = ("o_weight", "down_weight")


def _slice(shard: Shard, layer: int, module: str, attr: str, a: torch.Tensor,
           b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of one module: cut by the base weight's own rule (its HF name),
    A's input columns on a row-parallel linear, B's output rows on a column-parallel one."""
    block = "self_attn" if attr in ("qkv_weight", "o_weight") else "mlp"
    name = f"model.layers.{layer}.{block}.{module}.weight"
    if attr in _ROW_PARALLEL:
        return shard.take(name, a), b
    return a, shard.take(name, b)


def whole_sites(sites: dict[tuple[int, str], LinearSite], shard: Shard,
                intermediate: int) -> dict[tuple[int, str], LinearSite]:
    """The whole model's linears, from one rank's (an adapter's tensors are whole); the
    weight ids stay the rank's."""
    q, kv = shard.num_heads * shard.head_dim, shard.num_kv_heads * shard.head_dim
    whole = {}
    for key, site in sites.items():
        attr = key[1]
        if attr == "qkv_weight":
            parts, width = (q, kv, kv), site.in_features
        elif attr == "o_weight":
            parts, width = site.parts, q
        elif attr == "gate_up_weight":
            parts, width = (intermediate, intermediate), site.in_features
        else:
            parts, width = site.parts, intermediate
        whole[key] = LinearSite(site.weight_id, parts, width)
    return whole


def _site_of(path: str, layer: int, module: str, sites) -> tuple:
    target = TARGETS.get(module)
    if target is None:
        raise LoraError(f"adapter {path!r} targets {module!r}, which is not supported "
                        f"(supported: {', '.join(TARGETS)})")
    attr, part = target
    site = sites.get((layer, attr))
    if site is None or (part is not None and part >= len(site.parts)):
        raise LoraError(f"adapter {path!r} targets layer {layer} {module}, which this model "
                        f"does not have")
    return (layer, attr), part, site


class Adapter(msgspec.Struct):
    info: LoraAdapterInfo
    adapter_id: int
    users: int = 0  # sequences admitted with it and not finished
    unloaded: bool = False  # its name is gone; its weights go with its last user


class LoraManager:
    """The adapters one engine serves, by name (engine main thread only)."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.ops = LoraOps(model.ops)
        model.ops = self.ops  # every family's linears go through model.ops
        self.sites = linear_sites(model)
        tp = getattr(model, "tp", None)
        # Tensor parallel: adapters are checked whole and cut to this rank's slices.
        self.shard = tp.shard if tp is not None and tp.parallel else None
        self.rank_sites = None
        if self.shard is not None:
            self.rank_sites = self.sites
            self.sites = whole_sites(self.sites, self.shard, model.config.intermediate_size)
        # Rank 0 under tensor parallelism: sends a change to the other ranks, returns
        # (rank, "STATUS why") for each that could not apply it.
        self.peers = None
        self.dtype, self.device = model.dtype, model.device
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.by_name: dict[str, Adapter] = {}
        self._by_id: dict[int, Adapter] = {}
        self._next_id = 1  # 0: the base model

    def infos(self) -> list[LoraAdapterInfo]:
        return [a.info for a in self.by_name.values()]

    def load(self, info: LoraAdapterInfo) -> None:
        """Read, check and install an adapter under its name. Raises LoraError."""
        if info.name in self.by_name:
            raise LoraError(f"The lora adapter '{info.name}' has already been loaded.")
        resident = len(self._by_id)
        if self.max_cpu_loras and resident >= self.max_cpu_loras:
            raise LoraError(f"{resident} adapters are loaded, the most --max-cpu-loras "
                            f"allows; unload one first")
        products = self._read(info.path)
        adapter = Adapter(info, self._next_id)
        self._next_id += 1
        if self.peers is not None:
            failed = self.peers(LoraChange(adapter.adapter_id, info.path))
            if failed:  # the ranks that took it drop it again
                self.peers(LoraChange(adapter.adapter_id))
                rank, word = failed[0]
                status, _, why = word.partition(" ")
                raise LoraError(f"tensor-parallel rank {rank} cannot load it: {why}",
                                int(status) if status.isdigit() else 400)
        self.ops.install(adapter.adapter_id, products)
        self.by_name[info.name] = adapter
        self._by_id[adapter.adapter_id] = adapter
        log.info("LoRA adapter %r loaded from %s (id %d)", info.name, info.path,
                 adapter.adapter_id)

    def unload(self, name: str) -> None:
        """Forget a name; requests using it finish first. Raises LoraError (404)."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise LoraError(f"The lora adapter '{name}' cannot be found.", 404)
        adapter.unloaded = True
        self._drop_if_unused(adapter)
        log.info("LoRA adapter %r unloaded%s", name,
                 f" (its {adapter.users} requests finish first)" if adapter.users else "")

    def acquire(self, name: str) -> int:
        """A new request for `name`: its adapter id. Raises LoraError (404) if unknown."""
        adapter = self.by_name.get(name)
        if adapter is None:
            raise LoraError(f"The model '{name}' does not exist.", 404)
        adapter.users += 1
        return adapter.adapter_id

    def release(self, adapter_id: int) -> None:
        adapter = self._by_id.get(adapter_id)
        if adapter is not None:
            adapter.users -= 1
            self._drop_if_unused(adapter)

    def _drop_if_unused(self, adapter: Adapter) -> None:
        if adapter.unloaded and adapter.users <= 0:
            self.ops.remove(adapter.adapter_id)
            del self._by_id[adapter.adapter_id]
            if self.peers is not None:
                self.peers(LoraChange(adapter.adapter_id))

    def _read(self, path: str) -> dict[int, LowRank]:
        return read_adapter(path, self.sites, self.max_lora_rank, self.dtype, self.device,
                            self.shard, self.rank_sites)

    def apply(self, change: LoraChange) -> None:
        """Another rank: rank 0's load or removal, under rank 0's id. Raises LoraError."""
        if change.path:
            self.ops.install(change.adapter_id, self._read(change.path))
        else:
            self.ops.remove(change.adapter_id)
