"""--attn-implementation: what `auto` resolves to on each machine, what is refused (and why), and what the planner
and the simulated step count for the dense-mask choices."""

from __future__ import annotations

import re

import pytest

from hfdist.models import attention as choice
from hfdist.models.attention import DOCUMENT_ATTENTION, AttentionChoiceError, dense_mask_bytes, resolve_attention
from hfdist.models.presets import preset_shape
from hfdist.plan import GB, PlanError, Workload, plan_rungs


def _installed(monkeypatch, *packages):
    monkeypatch.setattr(choice, "_importable", lambda module: module in packages)


def test_auto_on_cpu_is_document_attention():
    assert resolve_attention("auto", on_gpu=False) == DOCUMENT_ATTENTION
    assert resolve_attention("auto", on_gpu=False, cp=2) == DOCUMENT_ATTENTION


@pytest.mark.parametrize("installed, cp, want", [
    (("flash_attn_interface", "flash_attn"), 1, "flash_attention_3"),
    (("flash_attn",), 1, "flash_attention_2"),
    (("flash_attn",), 2, "flash_attention_2"),
    ((), 1, "flex_attention"),
    ((), 2, DOCUMENT_ATTENTION),  # flex gets no BlockMask through the Ulysses exchange
])
def test_auto_on_gpu_takes_the_fastest_document_isolating_backend(monkeypatch, installed, cp, want):
    _installed(monkeypatch, *installed)
    assert resolve_attention("auto", on_gpu=True, cp=cp) == want


@pytest.mark.parametrize("name, on_gpu, installed, cp, said", [
    ("flash_attention_2", False, (), 1, "needs the 'flash_attn' package"),
    ("flash_attention_2", False, ("flash_attn",), 1, "runs on CUDA GPUs only"),
    ("flash_attention_3", True, ("flash_attn",), 1, "needs the 'flash_attn_interface' package"),
    ("flex_attention", False, (), 1, "no CPU backward"),
    ("flex_attention", True, (), 2, "under context parallelism (cp=2)"),
    ("kernels-community/flash-attn", False, ("kernels",), 1, "needs a CUDA GPU and the 'kernels' package"),
    ("kernels-community/sage-attention", True, ("kernels",), 1, "cannot give document boundaries to"),
])
def test_what_cannot_run_or_cannot_keep_documents_apart_is_refused(monkeypatch, name, on_gpu, installed, cp, said):
    _installed(monkeypatch, *installed)
    with pytest.raises(AttentionChoiceError, match=re.escape(said)) as err:
        resolve_attention(name, on_gpu=on_gpu, cp=cp)
    assert "--attn-implementation auto" in str(err.value) and "\n" not in str(err.value)


def test_explicit_choices_that_run_here():
    for name in ("sdpa", "eager", DOCUMENT_ATTENTION):
        assert resolve_attention(name, on_gpu=False) == name
    assert resolve_attention("flex_attention", on_gpu=False, training=False) == "flex_attention"  # forward only
    with pytest.raises(AttentionChoiceError, match="not one hfdist knows"):
        resolve_attention("flash", on_gpu=False)


def test_dense_mask_bytes():
    assert dense_mask_bytes("sdpa", seq=1024, micro_batch=2, heads=8, elem=2) == (2 * 1024**2, 2 * 1024**2 * 2)
    assert dense_mask_bytes("eager", seq=1024, micro_batch=1, heads=8, elem=2) == (4 * 1024**2, 1024**2 * 8 * 6)
    assert dense_mask_bytes("eager", seq=1024, micro_batch=1, heads=8, elem=4) == (4 * 1024**2, 1024**2 * 8 * 4)
    for name in (DOCUMENT_ATTENTION, "flash_attention_2", "flex_attention", "auto"):
        assert dense_mask_bytes(name, seq=1024, micro_batch=1, heads=8, elem=2) == (0, 0)


def _activations(config, rung: str, attention: str, **kw) -> int:
    plan = plan_rungs(config, [rung], gpus_per_node=8, gpu_mem_bytes=80 * GB, attention=attention, **kw)
    return plan.rungs[0].bytes.activations


def test_planner_counts_the_dense_mask_on_every_rank():
    """Llama-3.1-8B, bf16: sdpa adds the bool mask and a bf16 bias per layer (~4 GiB at 8K, as gpu-readiness B7
    reads it); under cp the whole mask on every rank and one shared bias; with activation checkpointing one
    layer's bias."""
    config = preset_shape("llama-3.1-8b")
    seq, layers = 8192, 32
    extra = _activations(config, "fsdp_full_shard", "sdpa", seq=seq) - _activations(config, "fsdp_full_shard", "auto",
                                                                                     seq=seq)
    assert extra == seq * seq * (1 + 2 * layers)
    assert 4 * 2**30 < extra < 5 * 2**30
    ckpt = dict(seq=seq, activation_checkpointing=True)
    assert (_activations(config, "fsdp_full_shard", "sdpa", **ckpt)
            - _activations(config, "fsdp_full_shard", "auto", **ckpt)) == seq * seq * 3
    seq = 131072  # the context fsdp_cp is for: 16 GiB of bools + 32 GiB of one bf16 bias per rank
    ckpt = dict(seq=seq, activation_checkpointing=True, cp=2, cp_method="ulysses")  # the rung's shipped degree
    assert (_activations(config, "fsdp_cp", "sdpa", **ckpt) - _activations(config, "fsdp_cp", "auto", **ckpt)) == \
        seq * seq * 3


def test_plan_recommends_auto_over_a_dense_mask_that_cannot_fit():
    # At 192K tokens the (S, S) mask alone is 34 GiB of bools on every rank, whatever the degrees.
    plan = plan_rungs(preset_shape("llama-3.1-8b"), gpus_per_node=8, gpu_mem_bytes=80 * GB, seq=196608,
                      activation_checkpointing=True, attention="sdpa")
    assert plan.recommended is None and "use --attn-implementation auto" in plan.hint
    assert "dense S x S document mask" in plan.assumptions()[2]
    fits = plan_rungs(preset_shape("llama-3.1-8b"), ["fsdp_full_shard"], gpus_per_node=8, gpu_mem_bytes=80 * GB,
                      attention="eager")
    assert "--attn-implementation eager" in fits.rungs[0].command
    with pytest.raises(PlanError, match="attention must be one of"):
        Workload(attention="flash")


def test_simulated_step_holds_the_dense_mask_the_planner_counts():
    """The sdpa mask and its saved per-layer bias in a fake-tensor step, against the planner's figure (the step
    also holds the bool -> float conversion's temporaries at its peak: within 10%)."""
    from hfdist.plan.simulate import simulate, simulation_rung

    rung = simulation_rung("fsdp_full_shard", 4)
    (plain,) = simulate("llama-tiny", rung, mixed_precision="fp32", step_seq=512, micro_batch=2).roles
    (dense,) = simulate("llama-tiny", rung, mixed_precision="fp32", step_seq=512, micro_batch=2,
                        attention="sdpa").roles
    assert dense.step.activation_bytes > plain.step.activation_bytes + 2 * 512 * 512 * (1 + 4 * 4) * 0.9
    assert dense.step.relative_error() < 0.10, dense.step
