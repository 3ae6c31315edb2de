"""The rung table as the test plan: every cell it accepts (hfdist.config.cells.accepted_cells: each rung with each
option it takes, each architecture of the registry on each rung, most of the dense ones inside the rung's option
cells: an option's cell and its reference then train that model) trains through the job's own path for 3 steps at
the job's defaults (the cosine schedule and its warm-up, clipping at 1.0, evaluation on held-out rows at the end),
and equals the single-process run of the same option and model: every step's loss and gradient norm (before
clipping, global over every rank and mesh) and the eval loss. A cell the table accepts and that does not hold
fails here, so a refusal turned into an acceptance without the work behind it fails CI.

One torchrun launch per world size runs all of its cells one after the other (tests/e2e/cells_worker.py: the job's
`train_in_world` in one world, the launcher's environment set per case), and one process runs the references; the
launches run side by side. The references are the single rung through the same path.

Tolerances (relative, per value; `RTOL`): fp32 1e-5 for every loss and the first step's gradient norm (reduction
order only: the ladder's), 5e-5 for the later steps' gradient norms: AdamW divides each gradient entry by its own
root mean square (+ eps 1e-8), so an entry that sums to rounding noise (|g| ~ 1e-9) moves its weight by a
different fraction of the learning rate in each layout, and the next gradient norm, unlike the loss, feels it
(measured up to 1.9e-5 at step 3 on ring attention, 1.5e-5 on 3d); bf16 2e-2 (8-bit significands, as
tests/e2e/test_bf16.py); float8 1e-3 for losses against the single-process float8 run (test_fp8.py's) and 1e-2 for
gradient norms (e4m3's 3-bit significands rounded by per-tensor scales: 4e-3 measured on 3d at step 3); compiled
layers 1e-4 against the eager single process (the compiler's kernels sum in orders of their own).
A planted factor (one rank's expert gradients x 2, the cp gradients x 0.5) moves a gradient norm by 2e-4 to 0.5,
above every one of these.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest

from hfdist.config.cells import DENSE_MODELS, Cell, accepted_cells
from hfdist.train.injected_faults import FIXED_COMPLETIONS_ENV, GRAD_SCALE_ENV

from helpers import GRAD_NORM_RTOL, run_cases, side_by_side

pytestmark = pytest.mark.multiproc

CELLS = accepted_cells()
# The job's defaults but the sizes (a tiny model's 3 steps) and what a comparison does not read (trackers, the
# saved model: saving is the ladder's to test). A hang would stop the whole world: 120 s, not 300, to say so.
BASE = ["--max-steps", "3", "--global-batch-size", "8", "--seq-len", "64", "--eval-fraction", "0.01", "--no-wandb",
        "--save-steps", "0", "--no-save-model", "--collective-timeout", "120"]
# The context-parallel rungs' cells: rows of 512 tokens, several documents each, cut into cp pieces.
LONG = ["--seq-len", "512", "--global-batch-size", "4"]
# numerics -> (loss, first step's gradient norm, later steps' gradient norms): see the module docstring.
RTOL = {"fp32": (1e-5, *GRAD_NORM_RTOL), "bf16": (2e-2, 2e-2, 2e-2), "fp8": (1e-3, 1e-2, 1e-2),
        "compile": (1e-4, 1e-4, 1e-4)}
REWARD_ATOL = 1e-5
# Faults planted in a cell's run (hfdist.train.injected_faults), which the comparison above must catch: rank 0's
# expert gradients doubled (an expert-parallel reduction that counts one rank's experts twice), and every rank's
# gradients halved on context parallelism (a wrong average over dp x cp). Under Adam, after clipping at 1.0, neither
# moves the losses beyond their tolerance; the gradient norm shows both.
PLANTED = {"planted/fsdp_ep/experts-x2": (Cell("fsdp_ep", "plain", "qwen3-moe-tiny"), "0:2.0:fsdp_ep:experts"),
           "planted/fsdp_cp/cp-grads-x0.5": (Cell("fsdp_cp", "cp:ulysses"), "*:0.5:fsdp_cp")}
# The mesh rungs whose surgery reads the model-facts registry (TP plan, FSDP unit, stage split): there the planner's
# bytes and the FLOPs count are held to each architecture (test_planner_and_flops_count_the_architecture).
MESH_RUNGS = ("fsdp_full_shard", "pp", "fsdp_tp", "3d")


# Per mesh rung, the cells of the architectures other than Llama that train there: the planner's check below.
ARCH_CELLS = [c for c in CELLS if c.rung in MESH_RUNGS and c.model in DENSE_MODELS[1:]]


def base_args(cell: Cell) -> list[str]:
    """BASE for `cell`: without the held-out rows for another objective than SFT (it reports its own series)."""
    if not cell.objective:
        return BASE
    at = BASE.index("--eval-fraction")
    return BASE[:at] + BASE[at + 2:]


def objective_env(cell: Cell) -> dict[str, str]:
    """The environment a cell (or reference) runs in: a GRPO cell's rollouts return fixed completions
    (hfdist.train.injected_faults), as sampling draws from each rank's own random stream."""
    return {FIXED_COMPLETIONS_ENV: "1"} if cell.option == "grpo" else {}


def cell_args(cell: Cell, nvme: Path) -> list[str]:
    """The job's command line for `cell` (its reference's for a single-process cell)."""
    extra = ["--nvme-path", str(nvme)] if cell.rung == "zero3_offload_nvme" else []
    return [*base_args(cell), *(LONG if cell.long_context else []), *cell.layout_args(), *cell.option_args(), *extra]


def world_size(cell: Cell) -> int:
    from hfdist.config.ladder import load_rung

    args = cell.layout_args()
    return int(args[args.index("--num-processes") + 1]) if "--num-processes" in args else \
        load_rung(cell.rung).num_processes


def reference_of(cell: Cell) -> tuple[Cell, bool]:
    """The key of the single-process run `cell` is compared with: its reference cell and the row length."""
    return cell.reference(), cell.long_context


def _selected(session: pytest.Session) -> tuple[list[Cell], list[str]]:
    """The cells and planted faults this session's selected tests read (all of them in the suite; `pytest -k
    "zero3 and lora"` trains that subset, and its references, only)."""
    here = [item for item in session.items if item.path == Path(__file__)]
    params = [item.callspec.params for item in here if hasattr(item, "callspec")]
    cells = {p["cell"] for p in params if "cell" in p}
    return [c for c in CELLS if c in cells], [n for n in PLANTED if any(p.get("name") == n for p in params)]


@pytest.fixture(scope="module")
def cells(request, tmp_path_factory) -> dict[str, dict]:
    """{cell name or reference key: {"error", "summary"}} for every selected cell, planted fault and reference."""
    root = tmp_path_factory.mktemp("cells")
    nvme = root / "nvme"
    nvme.mkdir()
    selected, planted = _selected(request.session)
    by_world: dict[int, list[dict]] = defaultdict(list)
    references = {reference_of(cell) for cell in [*selected, *(PLANTED[n][0] for n in planted)]}
    for ref, long in sorted(references, key=lambda r: (r[0].name, r[1])):
        key = f"{ref.name}{'@512' if long else ''}"
        by_world[1].append({"id": key, "output_dir": str(root / key.replace("/", "-")),
                            "args": [*base_args(ref), *(LONG if long else []), *ref.option_args()], "env": objective_env(ref)})
    for cell in selected:
        by_world[world_size(cell)].append({"id": cell.name, "output_dir": str(root / cell.name.replace("/", "-")),
                                           "args": cell_args(cell, nvme), "env": objective_env(cell)})
    for name in planted:
        cell, fault = PLANTED[name]
        by_world[world_size(cell)].append({"id": name, "output_dir": str(root / name.replace("/", "-")),
                                           "args": cell_args(cell, nvme), "env": {GRAD_SCALE_ENV: fault}})
    print(f"cells: {len(selected)} of the rung table's {len(CELLS)} accepted cells and {len(references)} single-process "
          f"references, "
          f"in launches of {', '.join(f'{w} process(es): {len(c)}' for w, c in sorted(by_world.items()))}")
    results: dict[str, dict] = {}
    for found in side_by_side({w: (lambda w=w: run_cases(by_world[w], w, root)) for w in by_world}).values():
        results.update(found)
    return results


def _numerics(cell: Cell, summary: dict) -> str:
    if cell.option == "compile":
        return "compile"
    if summary["strategy"]["fp8"]:
        return "fp8"
    return "bf16" if summary["strategy"]["mixed_precision"] == "bf16" else "fp32"


def mismatches(got: dict, ref: dict, rtol: tuple[float, float, float]) -> list[str]:
    """What differs between two summaries beyond `rtol` (RTOL's triple): each step's loss and gradient norm, the eval
    loss (SFT), the objective's series of rewards (DPO's implicit rewards, GRPO's reward: the same completions
    scored the same)."""
    found = []
    pairs = {"loss": (got["losses"], ref["losses"]), "grad_norm": (got["grad_norms"], ref["grad_norms"])}
    if got["objective"]["name"] == "sft":
        pairs["eval_loss"] = ([got["eval"]["loss"]], [ref["eval"]["loss"]])
    for name in ("rewards/margins", "reward"):
        if name in got["objective"]["series"]:
            pairs[name] = (got["objective"]["series"][name], ref["objective"]["series"][name])
    for what, (a, b) in pairs.items():
        if len(a) != len(b):
            found.append(f"{what}: {len(a)} values vs {len(b)}")
            continue
        for step, (x, y) in enumerate(zip(a, b), 1):
            tol = rtol[0] if what != "grad_norm" else rtol[1] if step == 1 else rtol[2]
            # An objective's rewards are differences of sequence log-probabilities (hundreds of nats, each summed in
            # fp32 to ~1e-5 of a nat): near zero, they are held to that absolute error, not a relative one.
            floor = REWARD_ATOL if what in ("rewards/margins", "reward") else 0.0
            if x is None or y is None or not math.isclose(x, y, rel_tol=tol, abs_tol=floor):
                found.append(f"{what} at step {step}: {x} vs {y} (rel {abs(x - y) / abs(y):.2e} > {tol:g})"
                             if x is not None and y is not None else f"{what} at step {step}: {x} vs {y}")
    return found


@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_cell_equals_one_process(cells, cell):
    ref, long = reference_of(cell)
    got, reference = cells[cell.name], cells[f"{ref.name}{'@512' if long else ''}"]
    assert reference["error"] is None, f"the reference {ref.name} failed:\n{reference['error']}"
    assert got["error"] is None, f"{cell.name} failed:\n{got['error']}"
    summary = got["summary"]
    assert len(summary["losses"]) == 3 and all(g is not None for g in summary["grad_norms"])
    wrong = mismatches(summary, reference["summary"], RTOL[_numerics(cell, summary)])
    assert not wrong, f"{cell.name} against {ref.name}: " + "; ".join(wrong)
    _assert_in_effect(cell, summary)


def _assert_in_effect(cell: Cell, summary: dict) -> None:
    """What the cell asked for is what ran (beyond the strategy check the job makes before step 1)."""
    from hfdist.config.ladder import load_rung

    strategy, rung = summary["strategy"], load_rung(cell.rung)
    assert strategy["name"] == cell.rung
    assert strategy["lora"] == (cell.option in ("lora", "qlora")) and strategy["qlora"] == (cell.option == "qlora")
    assert summary["objective"]["name"] == (cell.option if cell.objective else "sft")
    if cell.option == "ep":
        assert strategy["ep"] == (4 if cell.rung == "fsdp_ep" else 2)
    if cell.option.startswith("cp:"):
        assert strategy["cp_method"] == cell.option.split(":", 1)[1] and strategy["cp"] > 1
    if cell.option == "fp8":
        # Float8 linears on every rank, which FSDP2 gathers in float8 exactly where it shards them.
        records = [r["fp8"] for r in summary["ranks"]]
        gathered = "float8_e4m3fn" if rung.owns_sharding and rung.dims.dp_shard > 1 else None
        assert strategy["fp8"] and all(r["fp8_layers"] > 0 and r["fp8_all_gather_dtype"] == gathered
                                       for r in records), records
    if cell.option == "compile":
        records = [r["compile"] for r in summary["ranks"]]
        assert all(r["decoder_layers"] == r["compiled_layers"] > 0 and r["graphs"] >= 1 for r in records), records
    if cell.option == "bf16":
        _assert_bf16_ran(summary, deepspeed=rung.uses_deepspeed)


def _assert_bf16_ran(summary: dict, deepspeed: bool) -> None:
    """The dtypes every rank recorded while training: bf16 compute, the loss from fp32 logits, gradients reduced in
    fp32, fp32 weights (DeepSpeed: a bf16 model against fp32 master partitions), bf16 between pipeline stages."""
    assert summary["strategy"]["mixed_precision"] == "bf16"
    ranks = [r["precision"] for r in summary["ranks"]]
    assert all(p["compute_dtype"] == "bfloat16" for p in ranks), ranks
    losses = [p["loss_dtype"] for p in ranks if p["loss_dtype"] is not None]
    assert losses and set(losses) == {"float32"}, ranks
    assert {p["reduce_dtype"] for p in ranks} == {"float32"}, ranks
    assert {p["param_dtype"] for p in ranks} == {"bfloat16" if deepspeed else "float32"}, ranks
    if summary["strategy"]["pp"] > 1:
        handed = [p["activation_dtype"] for p in ranks if p["activation_dtype"] is not None]
        assert handed and set(handed) == {"bfloat16"}, ranks


@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_gradient_factor_fails_the_comparison(cells, name):
    """The comparison every cell passes catches the planted fault, by the gradient norms: the losses alone would not
    (the same within their tolerance)."""
    cell, _ = PLANTED[name]
    ref, long = reference_of(cell)
    got, reference = cells[name], cells[f"{ref.name}{'@512' if long else ''}"]
    assert got["error"] is None, f"{name} failed:\n{got['error']}"
    wrong = mismatches(got["summary"], reference["summary"], RTOL["fp32"])
    assert wrong and all(w.startswith("grad_norm") for w in wrong), wrong


def test_a_refusal_turned_into_an_acceptance_becomes_a_case(monkeypatch):
    """The plan is derived, not listed: the table's verdict alone adds a cell (which the module then trains)."""
    from dataclasses import replace

    import hfdist.config.cells as cells_module
    from hfdist.config.rungs import RUNG_INFO

    assert Cell("zero3", "moe", "qwen3-moe-tiny") not in accepted_cells()
    monkeypatch.setitem(RUNG_INFO, "zero3", replace(RUNG_INFO["zero3"], moe=True))
    assert Cell("zero3", "moe", "qwen3-moe-tiny") in cells_module.accepted_cells()


@pytest.mark.parametrize("cell", ARCH_CELLS, ids=[c.name for c in ARCH_CELLS])
def test_planner_and_flops_count_the_architecture(cells, cell):
    """The planner's per-rank param and optimizer bytes (averaged over ranks) against the measured mean (2%), on the
    mesh rungs; the FLOPs per token, the architecture's own count. Under the cell's option: LoRA / QLoRA's adapters
    (and 4-bit base) and bf16's dtypes (fp32 weights under FSDP2 either way); float8 linears and compiled layers keep
    fp32 weights."""
    from hfdist.config.ladder import load_rung
    from hfdist.metrics.flops import flops_per_token
    from hfdist.models.presets import load_config
    from hfdist.plan import predict_state_bytes

    summary = cells[cell.name]["summary"]
    assert summary is not None, cells[cell.name]["error"]
    assert summary["strategy"]["attn_implementation"] == "hfdist_documents"
    lora, qlora = cell.option in ("lora", "qlora"), cell.option == "qlora"
    want = predict_state_bytes(load_config(cell.model), load_rung(cell.rung), world=summary["strategy"]["world_size"],
                               dtype="bf16" if cell.option == "bf16" else "fp32", lora=lora, qlora=qlora)
    ranks = summary["ranks"]
    assert sum(r["param_bytes"] for r in ranks) / len(ranks) == pytest.approx(want.param_bytes, rel=0.02)
    measured = sum(r["optimizer_bytes"] + r["master_bytes"] for r in ranks) / len(ranks)
    assert measured == pytest.approx(want.optimizer_bytes, rel=0.02)
    assert summary["flops_per_token"] == pytest.approx(flops_per_token(load_config(cell.model), 64, lora=lora))


def test_the_planner_check_sees_every_architecture_on_each_mesh_rung():
    """Folding the architectures into option cells left every architecture of each mesh rung checked above."""
    assert sorted((c.rung, c.model) for c in ARCH_CELLS) == sorted((r, m) for r in MESH_RUNGS for m in DENSE_MODELS[1:])
