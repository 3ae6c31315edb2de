"""Ring attention's pure parts, in one process: which tokens each cp rank holds and which query / key pieces attend
(hfdist.parallel.ring_layout, against the brute-force rule: same document, key not later), and the block kernels
(hfdist.parallel.ring_kernels: the CPU flash kernel, the tiled one, one-token runs) against torch's sdpa, and the CUDA
flash kernel's calls against the op's own schema (meta device) and a CPU stand-in of the op. The ring itself (keys, values and their gradients travelling between ranks) trains in
tests/integration/test_context_parallel.py."""

from __future__ import annotations

import random

import pytest
import torch

from hfdist.errors import HfdistError
from hfdist.parallel.ring_kernels import (
    CpuFlashKernel,
    CudaFlashKernel,
    TiledKernel,
    attend_self,
    attend_self_backward,
    kernel_for,
)
from hfdist.parallel.ring_layout import chunk_ranges, rank_ranges, ring_segments, row_starts


def _random_rows(rng: random.Random, rows: int, seq: int) -> list[int]:
    """Flattened cu_seq_lens of rows packed with documents of 1-13 tokens (one-token runs, as packing's padding)."""
    cu = [0]
    for r in range(rows):
        pos = 0
        while pos < seq:
            pos += min(seq - pos, rng.choice([1, 1, 2, 3, 5, 8, 13]))
            cu.append(r * seq + pos)
    return cu


def _attended(segments, q_tokens: list[int], k_tokens: list[int], row: int) -> set[tuple[int, int]]:
    """The (query, key) global positions a member's segments of one source cover in `row`, each at most once."""
    pairs: set[tuple[int, int]] = set()
    for r, s in segments:
        if r != row:
            continue
        for i in range(s.q0, s.q1):
            for j in range(s.k0, s.k1):
                if (s.kind == "causal" and j - s.k0 > i - s.q0) or (s.kind == "self" and j - s.k0 != i - s.q0):
                    continue
                pair = (q_tokens[i], k_tokens[j])
                assert pair not in pairs
                pairs.add(pair)
    return pairs


@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_segments_cover_exactly_the_pairs_of_causal_document_attention(ring):
    """Over every source member, a member's segments cover each (query, key) pair with both in one document and the
    key not later exactly once, and nothing else, whatever the documents (random, one-token runs included)."""
    rng = random.Random(ring)
    for _ in range(20):
        seq, rows = 2 * ring * rng.randint(1, 6), rng.randint(1, 3)
        cu = _random_rows(rng, rows, seq)
        starts = row_starts(cu, rows, seq)
        for member in range(ring):
            mine = [p for a, b in chunk_ranges(seq, ring, member) for p in range(a, b)]
            segments = ring_segments(cu, rows, seq, ring, member)
            for row in range(rows):
                doc = [sum(s <= p for s in starts[row]) for p in range(seq)]
                want = {(q, k) for q in mine for k in range(seq) if doc[q] == doc[k] and k <= q}
                got = set()
                for source in range(ring):
                    theirs = [p for a, b in chunk_ranges(seq, ring, source) for p in range(a, b)]
                    got |= _attended(segments[source], mine, theirs, row)
                assert got == want


def test_head_tail_chunks_balance_causal_work_and_ranks_cover_the_row():
    """Each ring member holds chunks m and 2r - 1 - m, so every member's causal pairs are equal in a one-document
    row; the cp ranks of every layout (Ulysses, ring, hybrid) hold every token exactly once, a member's Ulysses
    group its chunks in order."""
    seq, ring = 48, 4
    work = [sum(p + 1 for a, b in chunk_ranges(seq, ring, m) for p in range(a, b)) for m in range(ring)]  # keys seen
    assert len(set(work)) == 1
    for cp, ulysses in [(4, 4), (4, 1), (4, 2), (6, 3), (6, 2)]:
        held = [rank_ranges(seq, cp, ulysses, c) for c in range(cp)]
        assert sorted(p for ranges in held for a, b in ranges for p in range(a, b)) == list(range(seq))
        for member in range(cp // ulysses):
            group = [p for c in range(member * ulysses, (member + 1) * ulysses) for a, b in held[c] for p in range(a, b)]
            assert group == [p for a, b in chunk_ranges(seq, cp // ulysses, member) for p in range(a, b)]


def test_boundaries_of_another_batch_are_refused():
    with pytest.raises(HfdistError, match="belong to another batch"):
        row_starts([0, 5, 10], 2, 8)
    with pytest.raises(HfdistError, match="crosses into row 1"):
        row_starts([0, 5, 10, 16], 2, 8)


@pytest.mark.parametrize("causal, n, m", [(True, 13, 13), (False, 9, 20)])
def test_kernels_return_sdpas_output_its_lse_and_gradients(causal, n, m):
    """Both kernels (grouped-query attention: 6 query heads over 2 kv heads) give sdpa's output, the log-sum-exp of
    the scores, and from them sdpa's gradients. fp32: observed <= 1e-6; bound 1e-5 (a softmax over 20 terms)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, n, 16), torch.randn(1, 2, m, 16), torch.randn(1, 2, m, 16)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=0.25, enable_gqa=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    scores = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.25
    if causal:
        scores = scores.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    for kernel in (CpuFlashKernel(), TiledKernel(tile=5)):
        out, lse = kernel.forward(q, k, v, causal, 0.25)
        assert (out - ref).abs().max() < 1e-5 and (lse - scores.logsumexp(-1)).abs().max() < 1e-5
        for got, want in zip(kernel.backward(grad, q, k, v, out, lse, causal, 0.25), (qr.grad, kr.grad, vr.grad)):
            assert got.shape == want.shape and (got - want).abs().max() < 1e-5


def test_one_token_runs_in_closed_form():
    """A run of one-token documents: each attends itself (out = its value, lse = its score), and from merged
    out / lse (the token attended earlier keys too) its gradients are the kernel's for that one key."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 6, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    out, lse = attend_self(q, k, v, 0.25)
    grad, merged_out, merged_lse = torch.randn_like(out), out * 0.7 + 0.1, lse + 0.3
    grads = attend_self_backward(grad, q, k, v, merged_out, merged_lse, 0.25)
    kernel = CpuFlashKernel()
    for i in range(5):
        one = slice(i, i + 1)
        o, l = kernel.forward(q[..., one, :], k[..., one, :], v[..., one, :], True, 0.25)
        assert (o - out[..., one, :]).abs().max() < 1e-6 and (l - lse[..., one]).abs().max() < 1e-5
        want = kernel.backward(grad[..., one, :], q[..., one, :], k[..., one, :], v[..., one, :],
                               merged_out[..., one, :], merged_lse[..., one], True, 0.25)
        for got, w in zip(grads, want):
            assert (got[..., one, :] - w).abs().max() < 1e-5


@pytest.fixture
def cuda_flash_on_cpu():
    """A CPU kernel for the CUDA flash ops (they have none): torch's CPU flash kernel behind the CUDA ops' schema,
    recording the head counts it is handed. CudaFlashKernel runs unchanged on CPU tensors through it."""
    seen: list[tuple[int, int]] = []

    def forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        seen.append((query.shape[1], key.shape[1]))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p,
                                                                              is_causal, scale=scale)
        rng = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
        return out, lse, None, None, query.shape[2], key.shape[2], *rng, torch.empty(0, dtype=query.dtype)

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, philox_seed, philox_offset, *, scale=None):
        seen.append((query.shape[1], key.shape[1]))
        assert cum_seq_q is None and cum_seq_k is None and (max_q, max_k) == (query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")
    try:
        yield seen
    finally:
        lib._destroy()


def test_cuda_kernel_calls_fit_the_ops_schema_on_the_meta_device():
    """The CUDA flash ops' meta kernels check the arguments as the CUDA ones take them (types, the positions of
    the lengths and the random state): forward and backward of a causal and a cross piece, shapes as the contract
    says."""
    kernel = CudaFlashKernel()
    for causal, n, m in ((True, 16, 16), (False, 8, 24)):
        q = torch.empty(1, 6, n, 64, dtype=torch.bfloat16, device="meta")
        k, v = (torch.empty(1, 2, m, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
        out, lse = kernel.forward(q, k, v, causal, 0.125)
        assert out.shape == q.shape and lse.shape == (1, 6, n) and lse.dtype == torch.float32
        grads = kernel.backward(torch.empty_like(out), q, k, v, out, lse, causal, 0.125)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("causal, n, m", [(True, 13, 13), (False, 9, 20)])
def test_cuda_kernel_gives_the_cpu_kernels_figures(cuda_flash_on_cpu, causal, n, m):
    """CudaFlashKernel on bf16 pieces, its op computed by the CPU stand-in: the CPU kernel's output, log-sum-exp and
    gradients (grouped-query attention: 6 query heads over 2 kv heads, which the CUDA path hands the op repeated
    and sums back). bf16: the group sums add three bf16-rounded gradients (a half unit each) and round twice more
    where the CPU kernel rounds one fp32 sum once, up to about 3 bf16 units (2^-8) of the largest gradient: bound 4
    units (measured 0.006 of the largest, 1.6 units); the output and lse are the same kernel's (measured equal)."""
    torch.manual_seed(0)
    q = torch.randn(1, 6, n, 16, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, m, 16, dtype=torch.bfloat16), torch.randn(1, 2, m, 16, dtype=torch.bfloat16)
    grad = torch.randn(1, 6, n, 16, dtype=torch.bfloat16)
    cuda, cpu = CudaFlashKernel(), CpuFlashKernel()
    out, lse = cuda.forward(q, k, v, causal, 0.25)
    want_out, want_lse = cpu.forward(q, k, v, causal, 0.25)
    assert (out.float() - want_out.float()).abs().max() <= 1e-6 and (lse - want_lse).abs().max() <= 1e-6
    for got, want in zip(cuda.backward(grad, q, k, v, out, lse, causal, 0.25),
                         cpu.backward(grad, q, k, v, want_out, want_lse, causal, 0.25)):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().max() <= 4 * 2 ** -8 * want.float().abs().max()
    assert cuda_flash_on_cpu == [(6, 6), (6, 6)]  # the CUDA op got the kv heads repeated
    # fp32 pieces (a run without bf16) take the tiled kernel, the flash op only half precision
    out32, _ = cuda.forward(q.float(), k.float(), v.float(), causal, 0.25)
    assert len(cuda_flash_on_cpu) == 2 and (out32 - want_out.float()).abs().max() < 2e-2


def test_each_device_gets_its_flash_kernel():
    assert isinstance(kernel_for(torch.device("cpu")), CpuFlashKernel)
    assert isinstance(kernel_for(torch.device("cuda", 0)), CudaFlashKernel)
    assert isinstance(kernel_for(torch.device("meta")), TiledKernel)
