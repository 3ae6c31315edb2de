"""Loading what `prepare` takes: the tokenizer of a model and a raw dataset (the embedded default, a local file or
folder, or a hub id)."""

from __future__ import annotations

import logging
from pathlib import Path

from hfdist.data.default import DATA_FILE, TOKENIZER_DIR
from hfdist.errors import DataError

__all__ = ["DataError", "load_tokenizer", "load_raw_dataset"]

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_tokenizer(model_spec: str | None, is_preset: bool):
    """The tokenizer for a model: the embedded one for presets, the model's own otherwise.

    Raises:
        DataError: no tokenizer can be read there (a checkpoint folder without its tokenizer files, say).
    """
    from transformers import AutoTokenizer

    source = str(TOKENIZER_DIR) if is_preset or model_spec is None else model_spec
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # transformers raises OSError, ValueError, TypeError, ... for a missing or broken one
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DataError(f"Cannot load the tokenizer of --model {model_spec} ({type(exc).__name__}: {first}). A "
                        "checkpoint folder needs its tokenizer files (tokenizer.json or tokenizer.model, with "
                        "tokenizer_config.json): copy them from the model it was fine-tuned from, or save them there "
                        "with tokenizer.save_pretrained.") from exc
    if tok.pad_token is None:
        # Llama tokenizers ship without a pad token; padding is masked from loss and attention, so EOS serves.
        tok.pad_token = tok.eos_token
    return tok


def load_raw_dataset(spec: str | None, split: str = "train"):
    """A `datasets.Dataset` (its `split`, "train" by default) from None (embedded default), a local file/folder, or
    a hub id."""
    import datasets

    if spec is None:
        return datasets.load_dataset("json", data_files=str(DATA_FILE), split="train")
    path = Path(spec)
    # datasets logs its own error before raising it; hfdist's paragraph below says what it means, once.
    library_log = logging.getLogger("datasets")
    level = library_log.level
    library_log.setLevel(logging.CRITICAL)
    try:
        if path.is_file():
            fmt = _LOCAL_FORMATS.get(path.suffix.lower())
            if fmt is None:
                raise DataError(f"--dataset {spec}: unsupported file type '{path.suffix}'. Use one of "
                                f"{', '.join(sorted(_LOCAL_FORMATS))}, a saved dataset folder, or a hub id.")
            return datasets.load_dataset(fmt, data_files=str(path), split="train")
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
                ds = datasets.load_from_disk(str(path))
                return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            return datasets.load_dataset(str(path), split=split)
        return datasets.load_dataset(spec, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types for "not found / offline"
        bad = _first_bad_json_line(path) if path.is_file() and path.suffix.lower() in (".json", ".jsonl") else None
        if bad is not None:
            raise DataError(f"--dataset {spec}: line {bad[0]} is not a JSON object ({bad[1]}). Each line of a JSON "
                            "Lines file must be one JSON object (one row): fix or drop that line.") from exc
        raise DataError(
            f"Cannot load dataset '{spec}' ({type(exc).__name__}: {str(exc)[:200]}). Pass a local "
            "json/jsonl/csv/parquet file (messages, conversations, prompt/completion, instruction/output, "
            "question/answer or text columns), a folder saved with save_to_disk, or omit --dataset for the "
            "embedded default."
        ) from exc
    finally:
        library_log.setLevel(level)


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """(line number, what is wrong) of the first line of a JSON Lines file that is not one JSON object; None when
    every line is one (or the file is one JSON document, as datasets also reads .json files)."""
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(1)
        if head == "[":
            return None
        f.seek(0)
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip())
            except json.JSONDecodeError as exc:
                return number, f"{exc.msg}, column {exc.colno}"
            if not isinstance(row, dict):
                return number, f"a JSON {type(row).__name__}, not an object"
    return None
