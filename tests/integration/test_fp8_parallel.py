"""FP8 on 2 gloo ranks: one launch (fp8_worker.py) checks the float8 scales of hfdist's tensor-parallel linears
against one process, and measures what FSDP2's float8 all-gather gathers.

- A float8 linear split over tp (column or row, tensorwise or rowwise) computes what the whole one computes: exactly
  (1e-6 relative) with fp32 partial sums; with the hardware kernel's bf16 rowwise outputs, the summed parts within
  bf16 rounding. Scales taken from each rank's slice instead (the tp reduction switched off) do not: the check can
  fail.
- llama-tiny at tp = 2 gives one process's float8 loss.
- Under FSDP2 over 2 ranks, one step (forward and backward) gathers the float8 projections at 1 byte per element
  (measured with a CommDebugMode that adds up the gathered tensors): the bytes are exactly what the shapes predict,
  and fall from fp32's and bf16's; rowwise gathers in the training precision; the tensorwise loss and gradients are
  one process's.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiproc

EXACT = 1e-6
BF16_ROUNDING = 2**-7  # a bf16 output's relative rounding is at most 2^-8; summed parts may add two of them


@pytest.fixture(scope="module")
def results(worker_results) -> dict:
    return worker_results["fp8"]  # fp8_worker.py on 2 ranks (tests/integration/conftest.py)


def _case(results: dict, name: str) -> dict:
    found = results[name]
    assert "error" not in found, f"{name}: {found['error']}\n{found.get('trace', '')}"
    return found


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("split", ["column", "row"])
def test_split_float8_linear_equals_the_whole_one_with_fp32_partial_sums(results, recipe, split):
    found = _case(results, f"linear/{recipe}/{split}/emulated")
    assert max(found.values()) < EXACT, found


@pytest.mark.parametrize("split", ["column", "row"])
def test_split_float8_linear_on_the_kernel(results, split):
    """torch._scaled_mm: tensorwise exact; rowwise writes bf16, so what is summed over tp (a row split's output, a
    column split's input gradient) is within bf16 rounding and the rest exact."""
    assert max(_case(results, f"linear/tensorwise/{split}").values()) < EXACT
    rowwise = _case(results, f"linear/rowwise/{split}")
    summed = "out" if split == "row" else "x_grad"
    assert rowwise[summed] < BF16_ROUNDING, rowwise
    assert max(v for k, v in rowwise.items() if k != summed) < EXACT, rowwise


@pytest.mark.parametrize("split", ["column", "row"])
def test_scales_of_a_slice_are_not_the_tensors(results, split):
    """The control: each rank scaling its slice by its own amax gives other float8 values than one process."""
    found = _case(results, f"linear/tensorwise/{split}/emulated/local_scales")
    assert max(found.values()) > 1e-3, found


@pytest.mark.parametrize("recipe,rtol", [("tensorwise", EXACT), ("rowwise", 1e-4)])
def test_tensor_parallel_model_gives_one_process_float8_loss(results, recipe, rtol):
    found = _case(results, f"tp/{recipe}")
    assert found["loss_rel"] < rtol, found


def _expected_gathered_bytes(mixed: str, float8_gathered: bool) -> int:
    """One step of fsdp_full_shard on llama-tiny: the root unit (embedding, final norm, lm_head) gathered once (kept
    through backward), every decoder layer twice (forward, and again in backward after resharding); a float8
    projection 1 byte per element, everything else the compute dtype's bytes."""
    from hfdist.models.build import meta_model

    element = 2 if mixed == "bf16" else 4
    total = 0
    for name, p in meta_model("llama-tiny").named_parameters():
        projection = ".layers." in name and name.endswith("proj.weight")
        gathers = 2 if ".layers." in name else 1
        total += gathers * p.numel() * (1 if projection and float8_gathered else element)
    return total


@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_fsdp2_gathers_float8_weights_in_float8(results, mixed):
    plain, tensorwise = _case(results, f"fsdp/{mixed}/None"), _case(results, f"fsdp/{mixed}/tensorwise")
    rowwise = _case(results, f"fsdp/{mixed}/rowwise")
    assert plain["gathered_bytes"] == _expected_gathered_bytes(mixed, False)
    assert tensorwise["gathered_bytes"] == _expected_gathered_bytes(mixed, True)
    assert tensorwise["gathered_bytes"] < 0.65 * plain["gathered_bytes"]  # fp32: 0.41 x, bf16: 0.61 x
    assert tensorwise["record"] == {"fp8_layers": 28, "fp8_recipe": "tensorwise",
                                    "fp8_all_gather_dtype": "float8_e4m3fn"}
    # rowwise scales need whole rows: its weights are gathered in the training precision, then cast
    assert rowwise["gathered_bytes"] == plain["gathered_bytes"]
    assert rowwise["record"] == {"fp8_layers": 28, "fp8_recipe": "rowwise", "fp8_all_gather_dtype": None}


def test_float8_all_gather_gives_one_process_loss_and_gradients(results):
    found = _case(results, "fsdp/no/tensorwise")
    assert found["loss_rel"] < EXACT and found["grad_rel"] < 1e-5, found
