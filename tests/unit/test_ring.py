"""Ring attention's pure parts, in one process: which tokens each cp rank holds and which query / key pieces attend
(hfdist.parallel.ring_layout, against the brute-force rule: same document, key not later), and the block kernels
(hfdist.parallel.ring_kernels: the CPU flash kernel, the tiled one every other device runs, one-token runs) against
torch's sdpa. The ring itself (keys, values and their gradients travelling between ranks) trains in
tests/integration/test_context_parallel.py."""

from __future__ import annotations

import random

import pytest
import torch

from hfdist.errors import HfdistError
from hfdist.parallel.ring_kernels import CpuFlashKernel, TiledKernel, attend_self, attend_self_backward
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
