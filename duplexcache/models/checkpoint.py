"""Checkpoint reading and strict loading, shared by every model in the pipeline.

A checkpoint is a file or a directory of ``*.safetensors`` (single or sharded with a
``*.index.json``) or ``*.pt`` / ``*.bin`` (loaded with ``weights_only=True``). A MiniCPM-o
checkpoint holds all stages in one state dict under per-component prefixes, so loading takes an
optional prefix that selects and strips one component. Each model's ``from_pretrained`` names
its own: ``llm.`` (thinker.py), ``apm.`` + ``audio_projection_layer.`` (audio_encoder.py),
``tts.`` (talker.py), ``vpm.`` + ``resampler.`` (vision.py: ``VPM_PREFIX``, ``RESAMPLER_PREFIX``;
the resampler's ``pos_embed`` is a non-persistent buffer, so it is not in the checkpoint).

Every failure is a ``CheckpointError`` naming the component, which the CLI turns into exit 2
and the server into an error event.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_TORCH_INDEX = "pytorch_model.bin.index.json"
_TORCH_SUFFIXES = (".pt", ".bin", ".pth")
_MAX_LISTED = 8  # keys listed per category in an error message


class CheckpointError(Exception):
    """A checkpoint that cannot be read, or whose keys/shapes do not match the model.

    ``missing``: keys the model has and the checkpoint lacks; ``unexpected``: the reverse;
    ``shape_mismatch``: ``(key, checkpoint_shape, model_shape)``; ``reason``: free text for
    failures that are not about keys (unreadable file, no config.json).
    """

    def __init__(
        self,
        component: str,
        missing: list[str] | tuple[str, ...] = (),
        unexpected: list[str] | tuple[str, ...] = (),
        shape_mismatch: list[tuple[str, tuple, tuple]] | tuple = (),
        reason: str | None = None,
    ) -> None:
        self.component = component
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.shape_mismatch = list(shape_mismatch)
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        parts = []
        if self.reason:
            parts.append(self.reason)
        if self.missing:
            parts.append(f"{len(self.missing)} missing keys: {_first(self.missing)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected keys: {_first(self.unexpected)}")
        if self.shape_mismatch:
            shown = [f"{k} (checkpoint {tuple(a)} vs model {tuple(b)})" for k, a, b in self.shape_mismatch]
            parts.append(f"{len(shown)} shape mismatches: {_first(shown)}")
        # With no details the component text is the whole message (CheckpointError("...") reads well).
        return f"{self.component}: " + "; ".join(parts) if parts else self.component


def _first(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def read_hf_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of a checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError("config", reason=f"no checkpoint at {path} (no such file or directory)")
    config_path = path / "config.json" if path.is_dir() else path.parent / "config.json"
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError as exc:
        raise CheckpointError("config", reason=f"no config.json at {config_path}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError("config", reason=f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError("config", reason=f"{config_path} is not a JSON object")
    return config


def checkpoint_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint: the file itself, the shards of an index, or all weight files."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError("checkpoint", reason=f"{path} does not exist")
    for index_name in (_SAFETENSORS_INDEX, _TORCH_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError("checkpoint", reason=f"cannot read shard index {index}: {exc}") from exc
            return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        files = sorted(p for p in path.iterdir() if p.suffix in _TORCH_SUFFIXES and p.is_file())
    if not files:
        raise CheckpointError("checkpoint", reason=f"no *.safetensors, *.pt or *.bin weight files in {path}")
    return files


def checkpoint_keys(path: str | Path) -> list[str]:
    """All tensor names of a checkpoint, read without loading safetensors data when possible."""
    keys: list[str] = []
    for file in checkpoint_files(path):
        if file.suffix == ".safetensors":
            keys.extend(_safetensors_keys(file))
        else:
            keys.extend(_load_torch_file(file).keys())
    return keys


def load_state_dict(path_or_dir: str | Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint (CPU). With ``prefix``, keep only keys under it, stripped.

    ``load_state_dict(dir, prefix="llm.")`` turns ``llm.model.norm.weight`` into ``model.norm.weight``.
    """
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path_or_dir):
        part = _load_safetensors(file, prefix) if file.suffix == ".safetensors" else _load_torch_file(file)
        for key, tensor in part.items():
            if prefix is not None:
                if not key.startswith(prefix):
                    continue
                key = key[len(prefix) :]
            if key in state:
                raise CheckpointError("checkpoint", reason=f"key {key!r} appears in more than one file ({file.name})")
            state[key] = tensor
    if prefix is not None and not state:
        found = sorted({k.split(".", 1)[0] + "." for k in checkpoint_keys(path_or_dir)})
        raise CheckpointError(
            "checkpoint", reason=f"no keys under prefix {prefix!r} in {path_or_dir} (prefixes: {found})"
        )
    return state


def _safetensors_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types (SafetensorError, OSError)
        raise CheckpointError("checkpoint", reason=f"cannot read {file}: {exc}") from exc


def _load_safetensors(file: Path, prefix: str | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            # Read only the tensors under the prefix: a full MiniCPM-o file also holds other stages.
            return {k: f.get_tensor(k) for k in f.keys() if prefix is None or k.startswith(prefix)}
    except Exception as exc:
        raise CheckpointError("checkpoint", reason=f"cannot read {file}: {exc}") from exc


def _load_torch_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and weights_only errors all mean "unreadable"
        raise CheckpointError("checkpoint", reason=f"cannot read {file}: {exc}") from exc
    # Training scripts often wrap the weights: {"state_dict": {...}} or {"model": {...}}.
    if isinstance(obj, dict) and len(obj) == 1:
        (only,) = obj.values()
        if isinstance(only, dict) and next(iter(obj)) in ("state_dict", "model"):
            obj = only
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError("checkpoint", reason=f"{file} does not hold a flat dict of tensors")
    return obj


def load_strict(module: nn.Module, state_dict: dict[str, torch.Tensor], component: str, assign: bool = False) -> None:
    """Load ``state_dict`` into ``module`` requiring exactly the same keys and shapes.

    Raises ``CheckpointError(component, missing, unexpected, shape_mismatch)`` before touching
    any parameter, so a failed load leaves the module unchanged.
    """
    expected = module.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatch = [
        (k, tuple(state_dict[k].shape), tuple(expected[k].shape))
        for k in expected
        if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mismatch:
        raise CheckpointError(component, missing, unexpected, mismatch)
    module.load_state_dict(state_dict, strict=True, assign=assign)
    logger.debug("%s: loaded %d tensors strictly", component, len(state_dict))
