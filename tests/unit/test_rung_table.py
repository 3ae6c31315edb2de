"""The rung table (hfdist.config.rungs.RUNG_INFO): consistent with itself and the shipped YAMLs, the one place the
planner's order, the option refusals (--compile, --qlora, --fp8) and the tests' rung lists come from; a rung added
as a YAML plus one entry shows up in all of them."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml

import hfdist.config.ladder as ladder
from hfdist.cli import main
from hfdist.config.cells import CP_CELL_METHODS, CP_REFUSED, DENSE_MODELS, Cell, accepted_cells
from hfdist.config.features import refuse_unless, rungs_taking, speaking_entry
from hfdist.config.finetune import ConfigError
from hfdist.config.ladder import CONFIG_ROOT, known_rung_names, load_rung
from hfdist.config.rungs import E2E_MODULES, FEATURE_FLAGS, FEATURES, RUNG_INFO, TESTED_OPTIONS, RungInfo
from hfdist.models.presets import load_config
from hfdist.parallel.parallelize import check_compile
from hfdist.plan import GB, plan_rungs
from hfdist.plan.bytes import offload_device

from helpers import ACCELERATE_FSDP1_TEMPLATE, table_rungs

TESTS = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ the table itself


@pytest.mark.parametrize("name", list(RUNG_INFO))
def test_entry_is_consistent(name):
    info = RUNG_INFO[name]
    assert info.e2e in E2E_MODULES and set(info.tested_with) <= set(TESTED_OPTIONS)
    if info.e2e != "reference":
        assert (TESTS / "e2e" / E2E_MODULES[info.e2e]).is_file()
    for feature in FEATURES:
        verdict = getattr(info, feature)
        assert verdict is True or verdict is False or (isinstance(verdict, str) and verdict), (feature, verdict)
        if feature in info.tested_with:
            assert info.takes(feature), f"{name} is tested with --{feature} but its entry does not take it"


def test_plan_order_is_a_strict_order_with_offload_last():
    orders = {name: info.plan_order for name, info in RUNG_INFO.items()}
    assert len(set(orders.values())) == len(orders)
    offload = {n for n in known_rung_names() if offload_device(load_rung(n)) != "none"}  # DeepSpeed's and FSDP2's
    assert offload and min(orders[n] for n in offload) > max(orders[n] for n in orders if n not in offload)
    assert min(orders, key=orders.get) == "single"


def test_rung_lists_of_the_tests_come_from_the_table():
    assert table_rungs("ladder") == [n for n in known_rung_names() if RUNG_INFO[n].e2e == "ladder"]
    assert set(table_rungs("pipeline")) == {n for n in known_rung_names() if load_rung(n).uses_pipeline}
    assert set(table_rungs("context_parallel")) == {n for n in known_rung_names() if load_rung(n).dims.cp > 1}
    assert table_rungs("moe") == [n for n in known_rung_names() if load_rung(n).dims.ep > 1]
    # Every shipped rung is trained end to end by exactly one module.
    assert sorted(table_rungs("ladder") + table_rungs("pipeline") + table_rungs("context_parallel")
                  + table_rungs("moe")) == sorted(known_rung_names())


# ------------------------------------------------------------------------------------------ the refusals


@pytest.mark.parametrize("feature", [f for f in FEATURES if f != "compile"])  # compile: test_compile_recipe.py
@pytest.mark.parametrize("name", list(RUNG_INFO))
def test_refusal_follows_the_entry(name, feature):
    rung, info = load_rung(name), RUNG_INFO[name]
    if info.takes(feature):
        refuse_unless(rung, feature)
        return
    with pytest.raises(ConfigError) as err:
        refuse_unless(rung, feature)
    text, flag = str(err.value), FEATURE_FLAGS.get(feature, f"--{feature}")
    assert text.startswith(f"{flag} does not run on {name}: ") and f"Drop {flag}" in text
    if isinstance(getattr(info, feature), str):
        assert getattr(info, feature) in text
    takers = rungs_taking(feature)
    assert (f"use a rung that takes it: {', '.join(takers)}" in text) if takers else ("no rung takes it yet" in text)


def test_a_degree_override_answers_as_the_rung_it_makes():
    """--pp 2 on fsdp_full_shard makes a pipeline: the pp entry answers, naming the layout."""
    rung = load_rung("fsdp_full_shard").with_num_processes(4, pp=2)
    assert speaking_entry(rung) == "pp"
    with pytest.raises(ConfigError, match=r"--compile does not run on fsdp_full_shard \(laid out as pp\): pipeline"):
        check_compile(rung)
    assert speaking_entry(load_rung("fsdp_full_shard").with_num_processes(4, tp=2)) == "fsdp_tp"


def test_a_users_yaml_answers_as_the_shipped_rung_of_its_shape(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(ACCELERATE_FSDP1_TEMPLATE))
    rung = load_rung(str(path))
    assert rung.info is None and speaking_entry(rung) == "fsdp_full_shard"
    check_compile(rung)


def test_a_layout_no_rung_has_is_refused():
    rung = load_rung("fsdp_cp").with_num_processes(8, pp=2)  # cp x pp without tp: no shipped rung
    assert speaking_entry(rung) is None
    with pytest.raises(ConfigError, match="no rung of hfdist's table has its layout"):
        check_compile(rung)
    with pytest.raises(ValueError, match="unknown feature"):
        refuse_unless(rung, "int4")


# ------------------------------------------------------------------------------------------ a rung added


FAKE = "fsdp_fake"
FAKE_INFO = RungInfo(2, "a rung added by a test", "params + grads + optimizer state", "never: it is a test's",
                     "--lora", plan_order=45, compile=True, qlora=True, fp8="fp8 is not wired to this test rung",
                     tested_with=frozenset({"lora", "qlora"}))


@pytest.fixture
def fake_rung(tmp_path, monkeypatch):
    """A rung added the documented way: its YAML among the shipped ones (a copy of the config root here) and one
    entry in the table."""
    root = tmp_path / "configs"
    shutil.copytree(CONFIG_ROOT, root)
    text = (CONFIG_ROOT / "accelerate_configs" / "fsdp_full_shard.yaml").read_text().splitlines()[1:]
    (root / "accelerate_configs" / f"{FAKE}.yaml").write_text("\n".join(["# A rung added by a test.", *text]))
    monkeypatch.setattr(ladder, "CONFIG_ROOT", root)
    monkeypatch.setitem(RUNG_INFO, FAKE, FAKE_INFO)
    return root


def _module(path: Path):
    """A test module imported afresh, so its module-level rung lists are computed from the table as it is now."""
    spec = importlib.util.spec_from_file_location(f"fresh_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rung_added_as_yaml_plus_entry_is_seen_everywhere(fake_rung, capsys):
    rung = load_rung(FAKE)
    assert FAKE in known_rung_names() and rung.info is FAKE_INFO
    # hfdist configs
    assert main(["configs", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == FAKE)
    assert row["scenario"] == FAKE_INFO.scenario and row["command"] == f"hfdist finetune --config {FAKE} --lora"
    # the planner's walk: between fsdp_full_shard (40) and zero3 (50)
    names = [r.name for r in plan_rungs(load_config("llama-3.1-8b"), gpus_per_node=8, gpu_mem_bytes=80 * GB).rungs]
    assert names.index("fsdp_full_shard") + 1 == names.index(FAKE) == names.index("zero3") - 1
    # the refusals: it takes --compile and --qlora, refuses --fp8 with its reason, and is offered by the others
    check_compile(rung)
    refuse_unless(rung, "qlora")
    with pytest.raises(ConfigError, match=f"--fp8 does not run on {FAKE}: fp8 is not wired to this test rung"):
        refuse_unless(rung, "fp8")
    with pytest.raises(ConfigError, match=f"use a rung that takes it: .*{FAKE}"):
        refuse_unless(load_rung("fsdp_tp"), "qlora")
    # the tests' rung lists
    ladder_module = _module(TESTS / "e2e" / "test_finetune_ladder.py")
    assert FAKE in ladder_module.FULL and FAKE in ladder_module.FULL_SHARDING
    assert FAKE in _module(TESTS / "e2e" / "test_lora_checkpoints.py").RUNGS
    fake = {(c.option, c.model) for c in accepted_cells() if c.rung == FAKE}  # test_cells.py
    assert ("plain", "llama-tiny") in fake and {"compile", "qlora"} <= {option for option, _ in fake}
    assert not any(option == "fp8" for option, _ in fake) and Cell(FAKE, "fp8") not in accepted_cells()
    assert FAKE in _module(TESTS / "unit" / "test_compile_recipe.py").TAKE
    assert FAKE in table_rungs(option="qlora")


# ------------------------------------------------------------------------------------------ the cells


# The accepted cells (hfdist.config.cells): 147 when every dense architecture had an `arch` cell of its own on every
# rung that takes dense models; 108 with most of them trained inside the rung's option cells.
ACCEPTED_CELLS = 108


def test_every_rung_that_takes_dense_models_trains_every_dense_architecture():
    cells = accepted_cells()
    assert len(cells) == ACCEPTED_CELLS and len(set(cells)) == len(cells)
    for rung, info in RUNG_INFO.items():
        if rung != "single" and info.dense is True:
            trained = {c.model for c in cells if c.rung == rung}
            assert set(DENSE_MODELS) <= trained, f"{rung} trains no cell of {set(DENSE_MODELS) - trained}"
            assert Cell(rung, "plain") in cells  # the full fine-tune stays Llama's (other tests read it)
            # an `arch` cell only for an architecture none of the rung's options took
            assert all(c.option != "arch" or not any(d.model == c.model for d in cells if d.rung == rung and d != c)
                       for c in cells if c.rung == rung)


def test_the_architectures_meet_many_options_and_the_cp_refusals_are_hfdists():
    """Each non-Llama architecture is trained with every one of bf16, LoRA, QLoRA, FP8 and compile on some rung (the
    assignment spreads them, rather than always giving one option the same architecture). CP_REFUSED, which keeps
    the cp cells off the architectures a method cannot split, is what hfdist's own check refuses at each cp rung's
    degrees for the tests' long rows (a real HF config), so every cp cell runs its model."""
    from hfdist.parallel.context_check import ContextParallelError, check_cp

    cells = accepted_cells()
    for model in DENSE_MODELS[1:]:
        assert {"bf16", "lora", "qlora", "fp8", "compile"} <= {c.option for c in cells if c.model == model}, model
    for rung in (r for r, info in RUNG_INFO.items() if info.e2e == "context_parallel"):
        for model, method in ((m, x) for m in DENSE_MODELS for x in CP_CELL_METHODS):
            args, dims = Cell(rung, f"cp:{method}", model).layout_args(), load_rung(rung).dims
            cp = int(args[args.index("--cp") + 1]) if "--cp" in args else dims.cp
            try:
                check_cp(load_config(model), cp, seq_len=512, tp=dims.tp, method=method)
                refused = False
            except ContextParallelError:
                refused = True
            assert refused == (method in CP_REFUSED.get(model, ())), (rung, model, method)
    assert not any(c.option.startswith("cp:") and c.option[3:] in CP_REFUSED.get(c.model, ()) for c in cells)


def test_the_ladder_page_shows_the_tables_current_cell_matrix():
    """docs/ladder.md's option and architecture matrix is rendered from the table (hfdist.report.cell_matrix): a
    verdict changed in the table without `python -m hfdist.report.cell_matrix --write docs/ladder.md` fails here."""
    from hfdist.report.cell_matrix import BEGIN, END, render_cell_matrix

    page = (TESTS.parent / "docs" / "ladder.md").read_text()
    block = page[page.index(BEGIN):page.index(END) + len(END) + 1]
    assert block == render_cell_matrix(), "run: python -m hfdist.report.cell_matrix --write docs/ladder.md"


def test_the_readme_shows_the_tables_current_summary():
    """README.md's one-table summary of what each rung takes is rendered from the same verdicts: a verdict changed in
    the table without `python -m hfdist.report.cell_matrix --write README.md` fails here."""
    from hfdist.report.cell_matrix import SUMMARY_BEGIN, SUMMARY_END, render_summary

    page = (TESTS.parent / "README.md").read_text()
    block = page[page.index(SUMMARY_BEGIN):page.index(SUMMARY_END) + len(SUMMARY_END) + 1]
    assert block == render_summary(), "run: python -m hfdist.report.cell_matrix --write README.md"
