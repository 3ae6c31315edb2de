"""The embedded default, loading, and the data API: packed rows, best-fit-decreasing placement, long documents,
collation for each attention implementation, caching and parallel tokenization."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hfdist.data import DataError, collate, collator_for, load_raw_dataset, load_tokenizer, prepare, prepare_with_report
from hfdist.data.default import DATA_FILE, generate_conversations
from hfdist.data.packing import best_fit_decreasing, padding_per_row


@pytest.fixture()
def tok():
    return load_tokenizer(None, is_preset=True)


def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_shipped_data_is_what_the_generator_makes():
    shipped = [json.loads(line) for line in DATA_FILE.read_text().splitlines()]
    assert shipped == generate_conversations()
    assert {c["messages"][0]["role"] for c in shipped} == {"system", "user"}  # the system turn is optional
    assert {sum(m["role"] == "assistant" for m in c["messages"]) for c in shipped} == {1, 2, 3}


def test_default_dataset_packs_documents_whole_with_restarting_positions(tok):
    packed, report = prepare_with_report(load_raw_dataset(None), tok, 128)
    assert packed.column_names == ["input_ids", "labels", "position_ids"] and len(packed) == report.blocks > 500
    assert report.documents == report.rows and report.split_rows == report.truncated == 0
    positions = np.asarray(packed["position_ids"])
    labels = np.asarray(packed["labels"])
    assert positions.shape == (len(packed), 128) and (positions[:, 0] == 0).all()
    starts = (positions[:, :-1] == 0) & (positions[:, 1:] == 1)
    assert starts.sum() == report.documents and starts.sum(axis=1).max() >= 2  # several conversations per block
    assert (labels[np.nonzero(positions == 0)] == -100).all()  # no document's first token, no padding has a label
    assert report.padding_tokens == padding_per_row(positions).sum() and 0 < report.padding_fraction < 0.05
    assert np.asarray(packed["input_ids"]).max() < len(tok)


def test_best_fit_decreasing_places_whole_documents_tightly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 100, 2000)
    blocks = best_fit_decreasing(lengths, 128)
    assert sorted(d for b in blocks for d in b) == list(range(2000))
    assert all(sum(lengths[d] for d in b) <= 128 for b in blocks)
    assert len(blocks) <= 1.08 * lengths.sum() / 128  # within 8% of no padding at all
    assert best_fit_decreasing([5, 3, 4, 4], 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="lengths must lie in"):
        best_fit_decreasing([9], 8)


def test_long_conversations_split_between_exchanges_restating_the_system_turn(tmp_path, tok):
    turns = [{"role": "system", "content": "Be exact."}]
    for i in range(6):
        turns += [{"role": "user", "content": f"Add {i} and {i}."}, {"role": "assistant", "content": f"{2 * i}"}]
    path = _write(tmp_path, [{"messages": turns}])
    packed, report = prepare_with_report(load_raw_dataset(path), tok, 48)
    assert report.split_rows == 1 and report.documents >= 3 and report.truncated == 0
    texts = [tok.decode([t for t, p in zip(r["input_ids"], r["position_ids"]) if p or t != tok.pad_token_id])
             for r in packed]
    pieces = [p for t in texts for p in t.split("<s>") if p]
    assert len(pieces) == report.documents
    assert all(p.startswith("### System:\nBe exact.\n\n### User:\n") for p in pieces)
    assert sum(p.count("### Assistant:") for p in pieces) == 6  # every exchange once, none cut
    with pytest.raises(DataError, match="Row 0 .* more than --seq-len 48.*--long-documents error"):
        prepare(load_raw_dataset(path), tok, 48, long_documents="error")


def test_an_exchange_longer_than_the_block_keeps_its_prompt_and_truncates_the_answer(tmp_path, tok):
    long_answer = " ".join(["apple"] * 200)
    path = _write(tmp_path, [{"instruction": "Repeat apple.", "response": long_answer},
                             {"instruction": " ".join(["pear"] * 200), "response": "no"}])
    packed, report = prepare_with_report(load_raw_dataset(path), tok, 64)
    assert (report.truncated, report.dropped_rows, report.documents, len(packed)) == (1, 1, 1, 1)
    row = packed[0]
    assert "Repeat apple." in tok.decode(row["input_ids"]) and sum(label != -100 for label in row["labels"]) > 20


def test_text_longer_than_the_block_is_cut_into_documents(tmp_path, tok):
    path = _write(tmp_path, [{"text": " ".join(["river stone"] * 100)}])
    packed, report = prepare_with_report(load_raw_dataset(path), tok, 32)
    assert report.split_rows == 1 and report.documents == len(packed) >= 6


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_local_files_load(tmp_path, tok, fmt):
    import datasets

    rows = [{"instruction": f"Say {i}.", "response": f"{i} {i} {i}"} for i in range(200)]
    path = tmp_path / f"d.{fmt}"
    ds = datasets.Dataset.from_list(rows)
    {"jsonl": ds.to_json, "csv": ds.to_csv, "parquet": ds.to_parquet}[fmt](str(path))
    assert len(prepare(load_raw_dataset(str(path)), tok, seq_len=64)) > 10
    with pytest.raises(DataError, match="unsupported file type"):
        (tmp_path / "x.txt").write_text("hi")
        load_raw_dataset(str(tmp_path / "x.txt"))


def test_in_memory_datasets_and_parallel_tokenization_give_the_same_rows(tok):
    import datasets

    rows = generate_conversations(600, seed=3)
    one = prepare(datasets.Dataset.from_list(rows), tok, 96)
    two = prepare(datasets.Dataset.from_list(rows), tok, 96, num_proc=2)
    assert one.to_dict() == two.to_dict() and not one.cache_files


def test_second_prepare_reads_the_cache(tmp_path, tok):
    path = _write(tmp_path, generate_conversations(400, seed=5))
    first = prepare(load_raw_dataset(path), tok, 96)
    cached = [f["filename"] for f in first.cache_files]
    assert cached and "hfdist-prepared-" in cached[0]
    again = prepare(load_raw_dataset(path), tok, 96)
    assert [f["filename"] for f in again.cache_files] == cached and again.to_dict() == first.to_dict()


def test_collate_builds_each_implementations_attention(tok):
    from hfdist.models.presets import load_config

    packed = prepare(load_raw_dataset(None), tok, 128)
    rows = [packed[i] for i in range(3)]
    sdpa = collate(rows)
    assert {k: tuple(v.shape) for k, v in sdpa.items()} == {
        "input_ids": (3, 128), "labels": (3, 128), "position_ids": (3, 128), "attention_mask": (3, 1, 128, 128)}
    assert sdpa["attention_mask"].dtype == torch.bool
    eager = collate(rows, attn_implementation="eager")["attention_mask"]
    assert eager.dtype == torch.float32 and ((eager == 0) == sdpa["attention_mask"]).all()
    flash = collate(rows, attn_implementation="flash_attention_2")
    assert "attention_mask" not in flash and flash["cu_seq_lens_q"][-1] == 3 * 128
    assert flash["cu_seq_lens_q"].diff().max() == flash["max_length_q"]
    documents = collate(rows, attn_implementation="hfdist_documents")
    assert documents.keys() == flash.keys() and torch.equal(documents["cu_seq_lens_q"], flash["cu_seq_lens_q"])
    # flex: position ids only (transformers builds the BlockMask from them, without a KV cache)
    assert collate(rows, attn_implementation="flex_attention").keys() == {"input_ids", "labels", "position_ids",
                                                                          "use_cache"}
    with pytest.raises(DataError, match="'paged|eager' attention implementation"):
        collate(rows, attn_implementation="paged|eager")
    config = load_config("llama-tiny", 1024)
    assert collator_for(config, 128)(rows).keys() == sdpa.keys()  # a config without a choice: transformers' sdpa
    config._attn_implementation = "hfdist_documents"
    assert collator_for(config, 128)(rows).keys() == flash.keys()


def test_sliding_windows_follow_the_layers():
    from hfdist.data.collation import block_causal_mask, sliding_window_for
    from hfdist.models.presets import load_config

    mistral = load_config("mistral-tiny", 1024)
    mistral.sliding_window = 16
    assert sliding_window_for(mistral, 64) == 16 and sliding_window_for(mistral, 16) is None
    mistral._attn_implementation = "hfdist_documents"  # applies each layer's window itself: no mask to window
    assert sliding_window_for(mistral, 64) is None
    mistral._attn_implementation = "sdpa"
    mask = block_causal_mask(torch.arange(32).unsqueeze(0), 16)[0, 0]
    assert mask[20].nonzero().flatten().tolist() == list(range(5, 21))
    qwen = load_config("qwen2-tiny", 1024)
    qwen.sliding_window, qwen.layer_types = 16, ["sliding_attention", "full_attention"] * 2
    with pytest.raises(DataError, match="mixes sliding-window"):
        sliding_window_for(qwen, 64)


def test_too_few_blocks_for_the_global_batch_are_refused():
    from hfdist.data.preparation import check_enough_blocks

    check_enough_blocks(16, 16, 64)
    with pytest.raises(DataError, match="packs into 9 blocks of 64 tokens, fewer than the --global-batch-size of 16"):
        check_enough_blocks(9, 16, 64)


def test_training_length_is_steps_or_epochs_not_both(capsys):
    from hfdist.config.finetune import parse_args

    assert parse_args([]).max_steps == 120 and parse_args([]).num_epochs is None
    assert parse_args(["--num-epochs", "1.5"]).num_epochs == 1.5
    for argv, message in ((["--num-epochs", "1", "--max-steps", "3"], "not allowed with argument"),
                          (["--num-epochs", "0"], "must be positive")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_collator_works_in_dataloader_workers(tok):
    """GPU runs collate in DataLoader worker processes (hfdist.job.run): the collator pickles, and the workers'
    batches are the main process's."""
    from torch.utils.data import DataLoader

    from hfdist.models.presets import load_config

    config = load_config("llama-tiny", 1024)
    config._attn_implementation = "hfdist_documents"
    packed = prepare(load_raw_dataset(None), tok, 128).select(range(8))
    here, there = (list(DataLoader(packed, batch_size=4, collate_fn=collator_for(config, 128), num_workers=n))
                   for n in (0, 2))
    for a, b in zip(here, there):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                            for k in a)
