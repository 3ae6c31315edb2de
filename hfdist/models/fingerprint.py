"""What identifies a frozen base model, cheaply: the fingerprint an adapter checkpoint records, so that `--resume`
refuses to put adapters onto another base than the one they were trained on.

An adapter checkpoint (LoRA, QLoRA: hfdist.checkpoint.trainer_hooks) holds the trainable parameters only; resuming it
rebuilds the base from --model. The model's name alone does not say the weights are the same: a local folder can be
overwritten, a hub repository moves on, a preset's weights are drawn from the run's seed. The fingerprint records:
- the model as given (preset name, folder or hub id) and, for a hub snapshot, the commit it was downloaded at;
- a digest of the config (config.json's bytes, or a preset's fields);
- a digest of the weights: for a preset, its seed (its weights are the seeded init); for safetensors, each file's
  name, size, header (names, dtypes, shapes, offsets) and a few 64 KiB windows of its data spread over the file.
  Reading a few hundred KiB per file keeps it cheap at 70B (no full hash of 140 GB), and two trainings or two seeds
  of the same shapes differ in every window.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

__all__ = ["base_fingerprint", "fingerprint_difference"]

_WINDOW = 64 * 1024  # bytes read at each sampled offset of a safetensors file's data
_WINDOWS = 4  # sampled offsets per file, spread from the data's start to its end


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _safetensors_digest(path: Path) -> bytes:
    """The file's name, size, header and sampled data windows, hashed (safetensors: an 8-byte header length, the
    JSON header, then the tensors' bytes)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        digest.update(f"{path.name}:{size}:".encode())
        digest.update(f.read(header_len))
        start = 8 + header_len
        span = max(size - start - _WINDOW, 0)
        for i in range(_WINDOWS):
            f.seek(start + span * i // max(_WINDOWS - 1, 1))
            digest.update(f.read(_WINDOW))
    return digest.digest()


def _hub_revision(folder: Path) -> str | None:
    """The commit of a hub snapshot folder (huggingface_hub's cache: .../snapshots/<commit>), or None."""
    return folder.name if folder.parent.name == "snapshots" else None


def base_fingerprint(model: str | None, seed: int) -> dict[str, Any]:
    """The fingerprint of the base `model` (a preset name, None for the default preset, a folder or a hub id) as a
    run with `seed` builds it: {"model", "revision", "config", "weights"}.

    Raises:
        FileNotFoundError: a folder without config.json or safetensors (the run's own checks say so earlier).
    """
    from hfdist.models.build import checkpoint_folder
    from hfdist.models.presets import DEFAULT_PRESET, PRESETS

    spec = model or DEFAULT_PRESET
    folder = checkpoint_folder(spec)
    if folder is None:
        preset = PRESETS[spec]
        config = json.dumps({"model_type": preset.model_type, **preset.fields}, sort_keys=True).encode()
        return {"model": spec, "revision": None, "config": _digest(config),
                "weights": _digest(f"{spec}: seeded init, seed {seed}".encode())}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    return {"model": spec, "revision": _hub_revision(folder), "config": _digest((folder / "config.json").read_bytes()),
            "weights": _digest(b"".join(_safetensors_digest(f) for f in files))}


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words ("weights a1b2... vs c3d4..."); empty when they agree."""
    return [f"{key} {saved.get(key)} vs {current.get(key)}" for key in ("revision", "config", "weights")
            if saved.get(key) != current.get(key)]
