"""Which tokens each cp rank holds, and which query/key pieces attend each other, under ring and hybrid context
parallelism: pure functions on integers (no torch), read by the sharding, the ring attention, the planner and tests.

A row of S tokens over a ring of r members, each a Ulysses group of u ranks (cp = r x u; hfdist.parallel
.context_check.CpPlan):

    the row is cut into 2r chunks of L = S / 2r, and ring member m attends (after its group's all-to-all) the tokens
    of chunks m and 2r - 1 - m, in that order ("head-tail", torch's round-robin load balancing): under causal
    attention chunk m sees m earlier chunks and chunk 2r - 1 - m sees 2r - 1 - m, so every member does the same
    work. cp rank c = m x u + j holds the j-th of u equal parts of its member's two chunks: what its embedding,
    layers and loss run on. Without a ring (r = 1: Ulysses) a member's share is the whole row, cut into cp
    contiguous parts, as Ulysses always cut it.

Block pairs: the queries of member m's chunks against the keys of member s's chunks (the keys travel around the
ring). Two chunks are either one chunk or disjoint, and a query attends a key iff both lie in one document and the
key is not later, so:

    a chunk against itself: each document piece in it attends itself causally ("causal"), a piece of one token
        only itself ("self": consecutive ones batched, the packing's padding);
    a chunk against an earlier chunk: only the document holding the later chunk's first token can span both, and
        its queries attend all its keys there ("full": no mask);
    a chunk against a later chunk: nothing.

Nothing here is S x S: a segment is four offsets, O(documents) of them per block pair.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

from hfdist.errors import HfdistError

__all__ = ["Segment", "RingLayoutError", "chunk_ranges", "rank_ranges", "row_starts", "block_segments",
           "ring_segments"]

Range = tuple[int, int]


class RingLayoutError(HfdistError, ValueError):
    """Document boundaries that do not describe the rows the ring attends."""


class Segment(NamedTuple):
    """Local query rows [q0, q1) attend local key rows [k0, k1): "causal" (same positions, lower triangle),
    "full" (every key is earlier), "self" (each query its own key only; q1 - q0 == k1 - k0)."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str


def chunk_ranges(seq: int, ring: int, member: int) -> list[Range]:
    """The global [start, stop) ranges ring member `member` attends, in local order (module docstring)."""
    if ring == 1:
        return [(0, seq)]
    chunk = seq // (2 * ring)
    tail = 2 * ring - 1 - member
    return [(member * chunk, (member + 1) * chunk), (tail * chunk, (tail + 1) * chunk)]


def rank_ranges(seq: int, cp: int, ulysses: int, cp_rank: int) -> list[Range]:
    """The global ranges cp rank `cp_rank` holds (its embedding, layers and loss), in local order: part
    cp_rank % ulysses of ring member cp_rank // ulysses's chunks."""
    member, part = divmod(cp_rank, ulysses)
    size = seq // cp
    begin, end = part * size, (part + 1) * size
    out, offset = [], 0
    for a, b in chunk_ranges(seq, cp // ulysses, member):
        lo, hi = max(a, a + begin - offset), min(b, a + end - offset)
        if lo < hi:
            out.append((lo, hi))
        offset += b - a
    return out


def row_starts(cu_seq_lens: list[int], rows: int, seq: int) -> list[list[int]]:
    """Each row's document starts (row-relative) from the flattened rows' cumulative boundaries (0, ..., rows x seq),
    the collator's cu_seq_lens.

    Raises:
        RingLayoutError: boundaries of another total, or a document crossing a row's end.
    """
    if not cu_seq_lens or cu_seq_lens[0] != 0 or cu_seq_lens[-1] != rows * seq:
        raise RingLayoutError(
            f"Ring attention got document boundaries ending at {cu_seq_lens[-1] if cu_seq_lens else None} for "
            f"{rows} rows of {seq} tokens: they belong to another batch. Build them from the whole rows' position "
            "ids before the rows are cut (hfdist.data.collation does).")
    starts: list[list[int]] = [[] for _ in range(rows)]
    for c in cu_seq_lens[:-1]:
        starts[c // seq].append(c % seq)
    crossing = [r for r, s in enumerate(starts) if not s or s[0] != 0]
    if crossing:
        raise RingLayoutError(f"A document crosses into row {crossing[0]} of {seq} tokens: packed rows must start a "
                              "document at their first token (position id 0), as hfdist.data.prepare packs them.")
    return starts


def _diagonal(a: int, b: int, offset: int, starts: list[int], seq: int) -> list[Segment]:
    """Chunk [a, b) (local rows from `offset`) against itself: each document piece causal, one-token pieces "self"."""
    out: list[Segment] = []
    i = bisect_right(starts, a) - 1
    while i < len(starts) and starts[i] < b:
        lo, hi = max(starts[i], a), min(starts[i + 1] if i + 1 < len(starts) else seq, b)
        q0, q1 = offset + lo - a, offset + hi - a
        if hi - lo == 1 and out and out[-1].kind == "self" and out[-1].q1 == q0:
            out[-1] = out[-1]._replace(q1=q1, k1=q1)
        else:
            out.append(Segment(q0, q1, q0, q1, "self" if hi - lo == 1 else "causal"))
        i += 1
    return out


def block_segments(q_ranges: list[Range], k_ranges: list[Range], starts: list[int], seq: int) -> list[Segment]:
    """Where the queries of `q_ranges` attend the keys of `k_ranges` (both chunks of one grid, in local order) in a
    row whose documents start at `starts`: the module docstring's three cases, in local coordinates."""
    out: list[Segment] = []
    q_offset = 0
    for qa, qb in q_ranges:
        k_offset = 0
        for ka, kb in k_ranges:
            if (qa, qb) == (ka, kb):
                out += _diagonal(qa, qb, q_offset, starts, seq)
            elif kb <= qa:
                i = bisect_right(starts, qa) - 1  # the document holding the query chunk's first token
                if starts[i] < kb:
                    end = min(starts[i + 1] if i + 1 < len(starts) else seq, qb)
                    out.append(Segment(q_offset, q_offset + end - qa, k_offset + max(starts[i], ka) - ka,
                                       k_offset + kb - ka, "full"))
            elif ka < qb:
                raise RingLayoutError(f"Chunks {qa, qb} and {ka, kb} overlap without being one: not a ring layout.")
            k_offset += kb - ka
        q_offset += qb - qa
    return out


def ring_segments(cu_seq_lens: list[int], rows: int, seq: int, ring: int,
                  member: int) -> list[list[tuple[int, Segment]]]:
    """For every source member s (index s), the (row, segment) pairs where member `member`'s queries attend member
    s's keys, for rows of `seq` tokens whose documents the flattened `cu_seq_lens` bound.

    Raises:
        RingLayoutError: boundaries that do not describe these rows.
    """
    starts = row_starts(cu_seq_lens, rows, seq)
    mine = chunk_ranges(seq, ring, member)
    return [[(r, seg) for r in range(rows) for seg in block_segments(mine, chunk_ranges(seq, ring, s), starts[r], seq)]
            for s in range(ring)]
