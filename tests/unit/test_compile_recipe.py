"""--compile's recipe in one process: which rungs take it (refused before launch elsewhere), every decoder layer
compiled in place and the run-time check that it is in effect (numerics: tests/e2e/test_cells.py)."""

from __future__ import annotations

import pytest

from hfdist.config.features import rungs_taking
from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import load_rung
from hfdist.config.rungs import RUNG_INFO
from hfdist.models.build import build_model
from hfdist.parallel.parallelize import apply_compile, check_compile, compile_record, verify_compiled
from hfdist.parallel.verify import StrategyNotInEffect

TAKE = rungs_taking("compile")  # the rung table: single, ddp, fsdp_full_shard, fsdp_hybrid, fsdp_tp


@pytest.mark.parametrize("name", TAKE)
def test_rungs_that_take_compile(name):
    check_compile(load_rung(name))


@pytest.mark.parametrize("name", [n for n in RUNG_INFO if n not in TAKE])
def test_rungs_that_refuse_compile_name_the_reason_and_the_fix(name):
    with pytest.raises(ConfigError, match=f"--compile does not run on {name}: ") as err:
        check_compile(load_rung(name))
    assert RUNG_INFO[name].compile in str(err.value)  # why, from the table
    assert f"Drop --compile, or use a rung that takes it: {', '.join(TAKE)}" in str(err.value)


def test_every_decoder_layer_is_compiled_in_place_and_checked():
    model = build_model("llama-tiny", vocab_size=1024)
    layers = list(model.model.layers)
    with pytest.raises(StrategyNotInEffect, match="0 of 4 decoder layers"):
        verify_compiled(load_rung("single"), model)
    assert apply_compile(model) == 4
    assert list(model.model.layers) == layers  # the same modules (FSDP2 later wraps these), not wrappers
    assert model.config.use_cache is False
    verify_compiled(load_rung("single"), model)
    assert compile_record(model)["compiled_layers"] == 4

