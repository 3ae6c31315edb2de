"""The combinations the rung table accepts, as cells: each rung with each option it takes and each architecture of
the model registry it trains. The table is the test plan: tests/e2e/test_cells.py trains every accepted cell
through the job's own path against one process, and docs/ladder.md's option matrix is rendered from the same
verdicts, so a refusal turned into an acceptance in hfdist.config.rungs is a case the suite runs (and fails, if
the combination does not hold) and a line the docs print.

A cell is (rung, option, model). Options: `plain` (the full fine-tune), `lora`, `qlora`, `fp8`, `compile`, `dpo` and
`grpo` (--objective dpo / grpo; GRPO on fixed completions), `bf16` (--mixed-precision bf16), `moe` (a mixture-of-experts architecture at the rung's own degrees), `ep` (the same with
--ep: expert parallelism where the rung takes it), `cp:<method>` (each context-parallel method on the rungs with
cp), and `arch` (a dense architecture of the registry other than Llama as a full fine-tune: `plain`'s with its
model). Each option's model is the architecture's tiny preset (hfdist.models.presets), so a cell runs on a laptop CPU.

Every dense architecture is trained on every rung that takes dense models, mostly inside the rung's option cells
(a case costs its start-up more than its 3 steps): the options other than `plain` that train a dense model
(CARRIER_OPTIONS) each carry one of the architectures other than Llama (`_assign_architectures`), and only an
architecture left over on a rung with fewer such options than architectures has an `arch` cell. `plain` stays on
Llama on every rung, and so does any option the rung has more of than architectures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from hfdist.config.rungs import FEATURES, RUNG_INFO, RungInfo

__all__ = ["Cell", "OPTIONS", "CARRIER_OPTIONS", "CP_CELL_METHODS", "CP_REFUSED", "accepted_cells", "cell_verdicts",
           "DENSE_MODELS", "MOE_MODELS"]

# The registry's architectures as the cells train them (their tiny presets); Llama is the default model of every
# other option's cells.
DENSE_MODELS = ("llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny")
MOE_MODELS = ("qwen3-moe-tiny", "mixtral-tiny", "llama4-tiny")
CP_CELL_METHODS = ("ulysses", "ring", "hybrid")
OPTIONS = ("plain", "bf16", *FEATURES, "moe", "ep", *(f"cp:{m}" for m in CP_CELL_METHODS))
# The options whose cells train an architecture of DENSE_MODELS other than Llama on a rung that takes dense models.
# The objectives train Llama: their cells test TRL's trainers under each layout, not the architectures again.
CARRIER_OPTIONS = tuple(o for o in OPTIONS if o not in ("plain", "moe", "ep", "dpo", "grpo"))
# The cp methods an architecture of DENSE_MODELS cannot take at the cells' degrees, which hfdist refuses before launch
# (hfdist.parallel.context_check.check_cp; tests/unit/test_rung_table.py holds this to it on every cp rung): those
# methods' cells stay on another architecture.
CP_REFUSED = {"mistral-tiny": ("ring", "hybrid")}  # its sliding window (32 tokens): a ring attends whole pieces


@dataclass(frozen=True)
class Cell:
    """One accepted combination: `rung` with `option` on `model` (a tiny preset)."""

    rung: str
    option: str
    model: str = "llama-tiny"

    @property
    def name(self) -> str:
        """The cell's id in tests and docs: rung/option[/model], the model named where it is not Llama's."""
        return "/".join([self.rung, self.option] + ([self.model] if self.model != "llama-tiny" else []))

    @property
    def long_context(self) -> bool:
        """Trained on long packed rows (the context-parallel rungs' cells)."""
        return RUNG_INFO[self.rung].e2e == "context_parallel"

    def layout_args(self) -> list[str]:
        """The command line that makes the rung's layout: --config and the option's degrees (empty for single)."""
        args = [] if self.rung == "single" else ["--config", self.rung]
        if self.option == "ep":
            # fsdp_tp: tp 2 x ep 2 on its 4 ranks; fsdp_ep (ep 2 in its YAML): every rank an expert shard.
            args += ["--ep", "4" if self.rung == "fsdp_ep" else "2"]
        if self.option == "fp8" and self.rung in ("pp", "3d"):
            # Float8 scales a matmul's activations as a whole: the pipeline's micro-batches hold one sequence each,
            # as the reference's (option_args) do (3d: its 4 micro-batches of a rank's 4 already).
            args += ["--pp-microbatches", "8"] if self.rung == "pp" else []
        if self.option.startswith("cp:"):
            method = self.option.split(":", 1)[1]
            args += ["--cp-method", method]
            if method == "hybrid":
                # Hybrid needs a Ulysses degree strictly between 1 and cp that divides cp and the heads per tp rank:
                # cp 4 (the tiny Llama's 4 heads: Ulysses over 2, a ring of 2); under tp 2 that takes 8 processes.
                args += ["--cp", "4"] + (["--num-processes", "8"] if self.rung == "fsdp_tp_cp" else [])
        return args

    def option_args(self) -> list[str]:
        """The command line of the option itself, the same for the cell and its single-process reference."""
        args = ["--model", self.model] if self.model != "llama-tiny" else []
        if self.option in ("lora", "qlora", "compile"):
            args.append(f"--{self.option}")
        elif self.option == "fp8":
            # One sequence per matmul, here and in the reference: float8's activation scales are per matmul.
            args += ["--fp8"] + ([] if self.rung in ("pp", "3d") else ["--micro-batch-size", "1"])
        elif self.option == "bf16":
            args += ["--mixed-precision", "bf16"]
        elif self.option in ("dpo", "grpo"):
            args += ["--objective", self.option]
        return args

    @property
    def objective(self) -> bool:
        """The cell trains another objective than SFT (no held-out evaluation: the objective's own series)."""
        return self.option in ("dpo", "grpo")

    def reference(self) -> Cell:
        """The single-process run this cell must equal: the same option and model on one process (a compiled cell
        against the eager one: the compiler's kernels sum in orders of their own; a cp method's cell against the
        plain one: one process has no cp)."""
        option = "plain" if self.option in ("compile", "moe", "ep", "arch") or self.option.startswith("cp:") \
            else self.option
        return Cell("single", option, self.model)


def _verdict(info: RungInfo, option: str) -> bool | str:
    """True where the rung's entry takes the option, else its reason (False: not built for it)."""
    if option == "arch":
        return info.dense
    if option in ("plain", "bf16"):
        return True
    if option in FEATURES:
        return getattr(info, option)
    if option == "moe":
        return info.moe
    if option == "ep":
        return True if info.takes_ep else "--ep splits experts over data-parallel ranks on fsdp_ep and fsdp_tp only"
    return True if info.e2e == "context_parallel" else "no context parallelism on this rung (fsdp_cp, fsdp_tp_cp)"


def _assign_architectures() -> dict[str, tuple[dict[str, str], list[str]]]:
    """{rung: ({option: model}, leftovers)} for every rung that takes dense models (single aside): which of the
    architectures other than Llama each of the rung's CARRIER_OPTIONS trains, and those left with an `arch` cell.

    The rungs in table order, each taking the assignment that (1) gives the most architectures an option (fewest
    `arch` cases), then (2) repeats the fewest earlier meetings: the sum, over its (architecture, option) pairs
    (a leftover's `arch`, Llama's with each option it keeps, included), of how many earlier rungs made that pair.
    So each architecture meets many options across rungs (today every one of them bf16, LoRA, QLoRA, FP8, compile),
    rather than one option always landing on one architecture; ties go to the options fewer rungs take (the table's
    order reversed: cp methods, compile, fp8 first), so the scarce ones leave Llama first.
    """
    others, met, plan = DENSE_MODELS[1:], Counter(), {}
    for rung, info in RUNG_INFO.items():
        if rung == "single" or info.dense is not True:
            continue
        options = [o for o in reversed(CARRIER_OPTIONS) if _verdict(info, o) is True]
        allowed = [[o for o in [*options, "arch"] if o not in [f"cp:{x}" for x in CP_REFUSED.get(m, ())]]
                   for m in others]
        best: tuple[tuple[int, int], list[tuple[str, str]]] | None = None
        for choice in product(*allowed):
            used = [o for o in choice if o != "arch"]
            if len(set(used)) < len(used):
                continue
            pairs = [*zip(others, choice), *((DENSE_MODELS[0], o) for o in options if o not in used)]
            score = (-len(used), sum(met[pair] for pair in pairs))
            if best is None or score < best[0]:
                best = (score, pairs)
        met.update(best[1])
        plan[rung] = ({o: m for m, o in best[1] if m != DENSE_MODELS[0] and o != "arch"},
                      [m for m, o in best[1] if o == "arch"])
    return plan


def cell_verdicts() -> Iterator[tuple[Cell, bool | str]]:
    """Every rung of the table (single included: the references) against every option, with the table's verdict
    (True, or why not), each option's cell on the architecture it trains there (_assign_architectures); the
    architecture rows as (rung, "arch", model): on a rung that takes dense models only the leftovers' (every
    other architecture is in an option's cell there), elsewhere every one's, with the refusal (single: every one,
    the references). MoE as one row per MoE architecture. A rung that takes no dense model trains its other
    options on the first MoE architecture."""
    plan = _assign_architectures()
    for rung, info in RUNG_INFO.items():
        default = DENSE_MODELS[0] if info.dense is True else MOE_MODELS[0]
        carriers, arch_rows = plan.get(rung, ({}, list(DENSE_MODELS)))
        for option in OPTIONS:
            verdict = _verdict(info, option)
            for model in MOE_MODELS if option in ("moe", "ep") else (carriers.get(option, default),):
                yield Cell(rung, option, model), verdict
        for model in arch_rows:
            yield Cell(rung, "arch", model), info.dense


def accepted_cells(include_single: bool = False) -> list[Cell]:
    """The cells the table accepts (table order), the single-process ones only with `include_single`; a cell whose
    command line another one already has (fsdp_ep's full fine-tune is its first MoE cell, single's Llama row its
    `plain`) once."""
    cells, seen = [], set()
    for cell, verdict in cell_verdicts():
        key = (cell.rung, *cell.layout_args(), *cell.option_args())
        if verdict is True and (include_single or cell.rung != "single") and key not in seen:
            seen.add(key)
            cells.append(cell)
    return cells
