"""Loading what `prepare` takes: the tokenizer of a model and a raw dataset (the embedded default, a local file or
folder, or a hub id)."""

from __future__ import annotations

from pathlib import Path

from hfdist.data.default import DATA_FILE, TOKENIZER_DIR
from hfdist.data.errors import DataError

__all__ = ["DataError", "load_tokenizer", "load_raw_dataset"]

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_tokenizer(model_spec: str | None, is_preset: bool):
    """The tokenizer for a model: the embedded one for presets, the model's own otherwise."""
    from transformers import AutoTokenizer

    source = str(TOKENIZER_DIR) if is_preset or model_spec is None else model_spec
    tok = AutoTokenizer.from_pretrained(source)
    if tok.pad_token is None:
        # Llama tokenizers ship without a pad token; padding is masked from loss and attention, so EOS serves.
        tok.pad_token = tok.eos_token
    return tok


def load_raw_dataset(spec: str | None):
    """A `datasets.Dataset` (train split) from None (embedded default), a local file/folder, or a hub id."""
    import datasets

    if spec is None:
        return datasets.load_dataset("json", data_files=str(DATA_FILE), split="train")
    path = Path(spec)
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
                return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
            return datasets.load_dataset(str(path), split="train")
        return datasets.load_dataset(spec, split="train")
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types for "not found / offline"
        raise DataError(
            f"Cannot load dataset '{spec}' ({type(exc).__name__}: {str(exc)[:200]}). Pass a local "
            "json/jsonl/csv/parquet file (messages, conversations, prompt/completion, instruction/output, "
            "question/answer or text columns), a folder saved with save_to_disk, or omit --dataset for the "
            "embedded default."
        ) from exc
