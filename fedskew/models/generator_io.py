"""Save, load and verify EDM2 generators without unpickling anything.

Generators arrive from other sites, so they are untrusted input: tensors travel as safetensors
(or plain arrays over Flower), the config as JSON, and both are checked against a model built
from the config before any weight is used.

On disk a generator is two files: `<stem>.safetensors` (the weights) and `<stem>.json`
({"format", "version", "config", "sha256" of the safetensors file, "tensors": name -> shape,
"extra": caller metadata}).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from fedskew.models.edm2 import GeneratorConfig, Precond, build_generator

FILE_FORMAT = "fedskew-edm2-generator"
FILE_VERSION = 1


class GeneratorFileError(ValueError):
    """A generator file or payload that does not match its config, shapes or checksum."""


def _as_numpy(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().cpu().numpy()
    return np.asarray(tensor, order="C")


def state_dict_checksum(state_dict: Mapping[str, torch.Tensor | np.ndarray]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in sorted-name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        array = _as_numpy(state_dict[name])
        header = json.dumps([name, str(array.dtype), list(array.shape)])
        digest.update(header.encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def state_dict_to_arrays(model: Precond) -> dict[str, np.ndarray]:
    """The model's weights and buffers as numpy arrays (e.g. for a Flower ArrayRecord)."""
    return {name: _as_numpy(tensor) for name, tensor in model.state_dict().items()}


def _check_tensors_match(reference: Mapping[str, torch.Tensor],
                         tensors: Mapping[str, torch.Tensor | np.ndarray]) -> None:
    expected = {name: tuple(tensor.shape) for name, tensor in reference.items()}
    missing = sorted(expected.keys() - tensors.keys())
    unknown = sorted(tensors.keys() - expected.keys())
    if missing or unknown:
        raise GeneratorFileError(
            f"generator tensors do not match the config's model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise GeneratorFileError(
                f"generator tensor {name!r} has shape {tuple(tensor.shape)}, the config's model needs {shape}"
            )
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != "float32":
            raise GeneratorFileError(f"generator tensor {name!r} has dtype {dtype}, expected float32")
        if not torch.isfinite(torch.as_tensor(tensor)).all():
            raise GeneratorFileError(f"generator tensor {name!r} holds non-finite values")


def _model_from_tensors(config: GeneratorConfig, tensors: Mapping[str, torch.Tensor | np.ndarray],
                        device: torch.device | str, checksum: str | None = None) -> Precond:
    """The generator, after checking names, shapes, dtypes and values and (given) the checksum, in that
    order: the checksum reads every tensor as float32."""
    model = build_generator(config, "meta")  # names and shapes only; no weights are drawn
    _check_tensors_match(model.state_dict(), tensors)
    if checksum is not None and (actual := state_dict_checksum(tensors)) != checksum:
        raise GeneratorFileError(f"generator checksum mismatch: payload has {actual}, metadata says {checksum}")
    # np.array copies: received arrays may be read-only buffers.
    state = {name: torch.from_numpy(np.array(_as_numpy(value))) for name, value in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


def generator_from_arrays(
    config: GeneratorConfig,
    arrays: Mapping[str, torch.Tensor | np.ndarray],
    checksum: str,
    device: torch.device | str = "cpu",
) -> Precond:
    """Rebuild a generator (eval mode) from received arrays after checking names, shapes, values and checksum."""
    return _model_from_tensors(config, arrays, device, checksum)


def _paths(path_stem: str | Path) -> tuple[Path, Path]:
    stem = Path(path_stem)
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def save_generator(model: Precond, config: GeneratorConfig, path_stem: str | Path,
                   extra_meta: dict | None = None) -> tuple[Path, Path]:
    """Write `<stem>.safetensors` and `<stem>.json`; returns both paths."""
    if model.config != config:
        raise ValueError("config does not match model.config; save the config the model was built from")
    weights_path, meta_path = _paths(path_stem)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    payload = safetensors_save(tensors)
    meta = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "config": config.to_dict(),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "tensors": {name: list(tensor.shape) for name, tensor in tensors.items()},
        "extra": extra_meta or {},
    }
    text = json.dumps(meta, indent=2, sort_keys=True)  # fails early if extra_meta is not JSON-able
    weights_path.parent.mkdir(parents=True, exist_ok=True)
    weights_path.write_bytes(payload)
    meta_path.write_text(text)
    return weights_path, meta_path


def _read_meta(meta_path: Path) -> dict:
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise GeneratorFileError(f"cannot read generator metadata {meta_path}: {error}") from error
    if not isinstance(meta, dict) or meta.get("format") != FILE_FORMAT or meta.get("version") != FILE_VERSION:
        raise GeneratorFileError(
            f"{meta_path} is not a {FILE_FORMAT} version {FILE_VERSION} file "
            f"(format {meta.get('format') if isinstance(meta, dict) else None!r})"
        )
    for key in ("config", "sha256", "tensors", "extra"):
        if key not in meta:
            raise GeneratorFileError(f"{meta_path} lacks the {key!r} entry")
    return meta


def load_generator(path_stem: str | Path, device: torch.device | str = "cpu") -> tuple[Precond, dict]:
    """Load and verify a saved generator; returns (model in eval mode, extra_meta).

    Raises GeneratorFileError when the checksum, config, tensor names or shapes do not match.
    """
    weights_path, meta_path = _paths(path_stem)
    meta = _read_meta(meta_path)
    try:
        config = GeneratorConfig.from_dict(meta["config"])
    except (TypeError, ValueError) as error:
        raise GeneratorFileError(f"{meta_path} holds an invalid generator config: {error}") from error
    try:
        payload = weights_path.read_bytes()
    except OSError as error:
        raise GeneratorFileError(f"cannot read generator weights {weights_path}: {error}") from error
    # Hash the same bytes we parse, so the file cannot change between check and use.
    actual = hashlib.sha256(payload).hexdigest()
    if actual != meta["sha256"]:
        raise GeneratorFileError(
            f"{weights_path} has sha256 {actual}, but {meta_path} records {meta['sha256']}: the file was altered"
        )
    try:
        tensors = safetensors_load(payload)
    except SafetensorError as error:
        raise GeneratorFileError(f"{weights_path} is not a valid safetensors file: {error}") from error
    stored = {name: list(tensor.shape) for name, tensor in tensors.items()}
    if meta["tensors"] != stored:
        raise GeneratorFileError(f"{meta_path} lists tensors that differ from those in {weights_path}")
    return _model_from_tensors(config, tensors, device), meta["extra"]
