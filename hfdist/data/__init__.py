"""Data for fine-tuning: any common format -> documents with assistant-only labels -> packed blocks that keep
documents apart -> the model's keyword arguments.

    from hfdist.data import prepare, collate
    packed = prepare(dataset, tokenizer, seq_len=2048)   # datasets.Dataset: input_ids, labels, position_ids
    batch = collate([packed[i] for i in range(8)])       # model(**batch): block-diagonal causal attention

Modules, one job each:
    formats.py   column detection; rows -> Conversation / PromptCompletion / Text, validated
    chat.py      chat templates (the tokenizer's, or hfdist's default) and the assistant spans in a rendering
    encode.py    samples -> tokenized, labelled documents; long ones split, truncated or refused
    packing.py   best-fit-decreasing placement of documents into fixed-length blocks with position ids
    packed_file.py  documents -> a packed Arrow file, a window of blocks at a time (bounded memory)
    collation.py packed rows -> model kwargs (document boundaries for hfdist_documents / flash varlen, a 4-D mask
                 only for the explicit sdpa / eager choice)
    preparation.py  the pipeline above as `prepare` (parallel, cached), held-out splits, the one-line report
    prepared.py  the prepared-data folder `hfdist prepare` writes and the job reads, checked against its settings
    load.py      a model's tokenizer; a dataset from the embedded default, a file/folder or the hub
    default.py   the embedded default: synthetic conversations and the tokenizer trained on them
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["DataError", "prepare", "prepare_with_report", "collate", "collator_for", "load_tokenizer",
           "load_raw_dataset"]

# Imported on first use: hfdist.models.presets reads hfdist.data.default without paying for torch or datasets.
_EXPORTS = {"prepare": "hfdist.data.cached", "prepare_with_report": "hfdist.data.cached",
            "collate": "hfdist.data.collation", "collator_for": "hfdist.data.collation", "load_tokenizer": "hfdist.data.load",
            "load_raw_dataset": "hfdist.data.load", "DataError": "hfdist.errors"}

if TYPE_CHECKING:
    from hfdist.data.cached import prepare, prepare_with_report
    from hfdist.data.collation import collate, collator_for
    from hfdist.data.load import load_raw_dataset, load_tokenizer
    from hfdist.errors import DataError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfdist.data' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
