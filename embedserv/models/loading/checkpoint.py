"""A model directory's checkpoint files and the tensors in them (loading/weights.py copies them in).

Safetensors is the format: it holds only tensors. A pickle checkpoint (pytorch_model.bin) can run code
when it is read, so it is loaded only with --allow-pickle, and even then through torch's weights-only
unpickler, which refuses anything but tensors and plain containers.
"""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from embedserv.errors import ConfigError

logger = logging.getLogger(__name__)

_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_PICKLE = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _indexed_files(model_dir: Path, index_name: str, single_name: str) -> list[Path] | None:
    """The index's shards when there is an index, else the single file, else None."""
    index = model_dir / index_name
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot read the shard index {index}: {exc!r}") from None
        files = [model_dir / shard for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists shards that are not there: {', '.join(missing[:5])}")
        return files
    single = model_dir / single_name
    return [single] if single.exists() else None


def checkpoint_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    """The checkpoint's files: safetensors (sharded or single) when present, else with `allow_pickle` the
    pytorch_model.bin files; refuses a pickle-only checkpoint without it."""
    files = _indexed_files(model_dir, _SAFETENSORS[1], _SAFETENSORS[0])
    if files is not None:
        return files
    pickles = _indexed_files(model_dir, _PICKLE[1], _PICKLE[0])
    if pickles is None:
        raise ConfigError(
            f"{model_dir} has no weights: neither model.safetensors (or model.safetensors.index.json) nor "
            "pytorch_model.bin; put the model's weights there"
        )
    if not allow_pickle:
        raise ConfigError(
            f"{model_dir} has only a pickle checkpoint ({pickles[0].name}), and loading a pickle can run code "
            "hidden in it. Convert it to safetensors (e.g. transformers' save_pretrained(..., "
            "safe_serialization=True) where you trust it), or pass --allow-pickle if you trust this checkpoint"
        )
    logger.warning(
        "%s: loading the pickle checkpoint %s (--allow-pickle), tensors only; convert it to safetensors to "
        "load faster and safer",
        model_dir,
        pickles[0].name,
    )
    return pickles


def _refusal_reason(exc: pickle.UnpicklingError) -> str:
    """The weights-only unpickler's own reason ("Unsupported global: GLOBAL posix.system ..."), without
    torch's advice to load the file unsafely."""
    text = str(exc)
    _, found, rest = text.partition("WeightsUnpickler error:")
    if found:
        return rest.strip().split(". ")[0].split("\n")[0].strip()
    # A global of a module torch blocks outright is worded apart, after the advice paragraph: "Trying to
    # load unsupported GLOBAL posix.getcwd whose module posix is blocked."
    blocked = [line.strip().rstrip(".") for line in text.splitlines() if line.startswith("Trying to load")]
    if blocked:
        return blocked[0]
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _pickle_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A pytorch_model.bin's tensors, read by torch's weights-only unpickler: code objects are refused, not run."""
    try:
        # mmap keeps a big checkpoint out of RAM; torch can map only the zip format (torch >= 1.6 saves).
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        raise ConfigError(
            f"{path} was refused, even with --allow-pickle: it holds more than tensors ({_refusal_reason(exc)}), "
            "and unpickling it could run code. Convert a checkpoint you trust to safetensors"
        ) from None
    except Exception as exc:  # damaged input fails the unpickler in many ways (IndexError, KeyError, ...)
        raise ConfigError(
            f"cannot read the pickle checkpoint {path} ({type(exc).__name__}: {exc}); it may be damaged"
        ) from None
    if not isinstance(state, Mapping):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict of named tensors")
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            yield str(name), tensor


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint files, safetensors or (allowed) pickle."""
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from _pickle_tensors(path)


def has_tensor(files: list[Path], name: str) -> bool:
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if name in f.keys():
                    return True
        elif any(found == name for found, _ in _pickle_tensors(path)):
            return True
    return False


def read_tensor(files: list[Path], name: str, rows: slice | None = None) -> torch.Tensor | None:
    """One named tensor (or some of its rows) from the checkpoint files; None when none has it."""
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if name in f.keys():
                    return f.get_slice(name)[rows] if rows is not None else f.get_tensor(name)
            continue
        for found, tensor in _pickle_tensors(path):
            if found == name:
                return tensor[rows] if rows is not None else tensor
    return None


def read_first_tensor(files: list[Path], names: tuple[str, ...], rows: slice | None = None) -> torch.Tensor:
    """The first of `names` the checkpoint holds (a head's tensor under its families' names)."""
    for name in names:
        tensor = read_tensor(files, name, rows)
        if tensor is not None:
            return tensor
    raise ConfigError(f"checkpoint {files[0].parent} lacks the head tensor {names[0]!r}")


def read_tensors(files: list[Path], names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors the checkpoint files hold (each file opened once; names it lacks are left out)."""
    found: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                found.update((name, f.get_tensor(name)) for name in names & set(f.keys()))
        else:
            found.update((name, tensor) for name, tensor in _pickle_tensors(path) if name in names)
    return found


def read_head_file(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A head's weights saved beside the model (bge-m3's sparse_linear / colbert_linear): safetensors, or a
    torch.save'd state dict only with `allow_pickle`, under the same policy as the checkpoint."""
    if path.suffix != ".safetensors" and not allow_pickle:
        raise ConfigError(
            f"{path} is a pickle file, and loading a pickle can run code hidden in it. Convert it to safetensors "
            f"(safetensors.torch.save_file of its state dict, where you trust it, as {path.stem}.safetensors), or "
            "pass --allow-pickle if you trust this checkpoint"
        )
    if path.suffix != ".safetensors":
        logger.warning("loading the pickle file %s (--allow-pickle), tensors only; convert it to safetensors", path)
    return dict(iterate_weights([path]))
