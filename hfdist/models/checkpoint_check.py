"""A local checkpoint folder checked before any process starts: every safetensors file whole, its index naming files
that exist, and the model's weights there at the model's shapes.

Every rank later reads its slices of each tensor through torch.distributed.checkpoint, which meets a file cut short
(a copy or download that stopped) as an AssertionError deep inside a rank, after the launch, and a tensor of another
shape as a size mismatch there. Here the headers alone are read (8 bytes of length, then JSON naming each tensor's
dtype, shape and byte range), so the check costs milliseconds at any model size. Names follow transformers' own
conversion (hfdist.models.conversion): a checkpoint holding an MoE layer's experts one by one matches the model's
stacked experts, as from_pretrained would load it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hfdist.models.presets import ModelSpecError

__all__ = ["safetensors_header", "checkpoint_headers", "check_checkpoint_files"]

_INDEX = "model.safetensors.index.json"


def safetensors_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, checked to hold every byte its header names.

    Raises:
        ModelSpecError: not a safetensors file, or one cut short (naming the bytes it has and needs).
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        try:
            if not 0 < length <= size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        except ValueError as exc:  # bad length, bad JSON or bad UTF-8
            raise ModelSpecError(f"{file} is not a readable safetensors file ({exc}). Replace it with the file the "
                                 "checkpoint was saved with (copy or download it again).") from exc
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    needed = 8 + length + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if size < needed:
        raise ModelSpecError(f"{file} is cut short: it holds {size:,} bytes of the {needed:,} its header names (an "
                             "interrupted copy or download?). Copy or download the file again.")
    return {k: tuple(v["shape"]) for k, v in tensors.items()}


def checkpoint_headers(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Tensor name -> (file, shape) over the folder's safetensors files, through its index when there is one."""
    index = folder / _INDEX
    files = sorted(folder.glob("*.safetensors"))
    named: dict[str, str] = {}
    if index.is_file():
        try:
            named = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelSpecError(f"{index} is not a safetensors index (no readable weight_map: {exc}). Replace it "
                                 "with the one save_pretrained wrote.") from exc
        lost = sorted({f for f in named.values() if not (folder / f).is_file()})
        if lost:
            raise ModelSpecError(f"{index} names {len(lost)} file(s) the folder does not hold ({', '.join(lost[:3])}"
                                 f"{', ...' if len(lost) > 3 else ''}). Copy every *.safetensors file of the "
                                 "checkpoint into the folder.")
        files = sorted({folder / f for f in named.values()})
    found = {name: (file, shape) for file in files for name, shape in safetensors_header(file).items()}
    absent = [k for k in named if k not in found]
    if absent:
        raise ModelSpecError(f"{index} lists {len(absent)} tensor(s) no file holds (e.g. {absent[:3]}). The files "
                             "and the index are of different checkpoints: copy the checkpoint's folder whole.")
    return found


def check_checkpoint_files(folder: Path, config) -> None:
    """The checkpoint in `folder` against the model `config` builds: whole files, every weight present, each at the
    model's shape.

    Raises:
        ModelSpecError: naming the file or the tensors, and the fix.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from hfdist.models.conversion import checkpoint_layout, hf_key

    found = checkpoint_headers(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    layout = checkpoint_layout(model, found)
    missing, wrong = [], []
    for name, param in model.named_parameters():  # a tied lm_head is the embedding: listed once
        key = hf_key(name)
        if key in layout.stacked:
            source = layout.stacked[key]
            shape = source.shape({k: found[k][1] for keys in source.groups for k in keys})[0]
            if shape != tuple(param.shape):
                first = source.groups[0][0]
                wrong.append(f"{key} stacks {sum(map(len, source.groups))} tensors like {first} "
                             f"({list(found[first][1])} in {found[first][0].name}) into "
                             f"{list(shape) if shape else 'no common shape'}, the model's is {list(param.shape)}")
            continue
        key = layout.direct.get(key, key)
        if key not in found:
            missing.append(key)
        elif found[key][1] != tuple(param.shape):
            wrong.append(f"{key} is {list(found[key][1])} in {found[key][0].name}, the model's is {list(param.shape)}")
    if missing:
        raise ModelSpecError(f"The checkpoint in {folder} lacks {len(missing)} of the model's weights (e.g. "
                             f"{missing[:3]}): its config.json describes another model than its safetensors hold, or "
                             "files are missing. Point --model at the folder save_pretrained wrote, whole.")
    if wrong:
        raise ModelSpecError(f"The checkpoint in {folder} holds weights of other shapes than its config.json gives "
                             f"the model ({'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}). Use the "
                             "config.json the weights were saved with.")
