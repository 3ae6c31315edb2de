"""The run-time check refuses a model that is not in the state the requested strategy implies."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hfdist.config.ladder import load_rung
from hfdist.models.build import build_model
from hfdist.parallel.verify import StrategyNotInEffect, verify_strategy


@pytest.fixture(scope="module")
def model():
    return build_model("llama-tiny", vocab_size=1024)


def _one_process(name):
    rung = load_rung(name)
    if name == "pp":  # pp=2 cannot shrink to one process; keep its dims, pretend the world matches
        return replace(rung, num_processes=1)
    return rung.with_num_processes(1) if name != "fsdp_hybrid" else rung


def test_single_process_model_passes_as_single(model):
    verify_strategy(load_rung("single"), model, model, lora=False)


def test_world_size_mismatch_is_refused(model):
    with pytest.raises(StrategyNotInEffect, match="needs 2"):
        verify_strategy(load_rung("ddp"), model, model, lora=False)


@pytest.mark.parametrize("name, why", [("ddp", "not DistributedDataParallel"),
                                       ("fsdp_full_shard", "not FSDP2 modules"),
                                       ("zero3", "not a DeepSpeedEngine"),
                                       ("pp", "not hfdist's PipelineModel")])
def test_fallback_to_a_plain_model_is_refused(model, name, why):
    """What accelerate does on CPU with an FSDP config (DDP or nothing) must not pass as the rung."""
    with pytest.raises(StrategyNotInEffect, match=why):
        verify_strategy(_one_process(name), model, model, lora=False)


def test_ddp_wrapper_passes_for_fsdp_rung_is_still_refused(model):
    ddp_like = torch.nn.Sequential(model)  # any wrapper that is not FSDP2
    with pytest.raises(StrategyNotInEffect):
        verify_strategy(_one_process("fsdp_full_shard"), ddp_like, model, lora=False)


def test_lora_requested_but_absent_is_refused(model):
    with pytest.raises(StrategyNotInEffect, match="--lora"):
        verify_strategy(load_rung("single"), model, model, lora=True)


def test_attention_other_than_resolved_is_refused(model):
    """The model attends with transformers' default (sdpa) while the run resolved hfdist_documents: its batches carry
    no mask, so the documents would mix; the check names both."""
    verify_strategy(load_rung("single"), model, model, lora=False, attention="sdpa")
    with pytest.raises(StrategyNotInEffect, match="attends with sdpa, not the --attn-implementation resolved for this "
                                                  r"run \(hfdist_documents\)"):
        verify_strategy(load_rung("single"), model, model, lora=False, attention="hfdist_documents")
