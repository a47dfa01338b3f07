"""The decode launches' tuning, as values: one frozen ``DecodeConfig`` held by the step's ``DecodeBuffers`` (the
grid splits are sized with the buffers, once, so that one captured graph serves every step).

Every field changes speed only, never a result; the alternatives measured and not kept are in docs/tuning.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode launches.

    score_split_min_candidates: a score program handles at least this many candidates (the score launch is split
        over a request's candidates for occupancy). score_programs_per_sm: score programs a multiprocessor gets before
        a (request, KV head) is split no further, where a batch has at most as many (request, KV head) rows as the
        GPU has multiprocessors; score_programs_per_sm_wide: the same beyond that. score_block: candidates a score
        program loads at once (summaries ``[score_block, D]``; half as many above D 128); score_stages, score_warps:
        the score launch's ``num_stages`` and ``num_warps``.
    attn_split_max: the most splits of one request's attention.
    attn_programs_per_sm: attention programs a multiprocessor gets before a (request, KV head) is split no further.
    attn_split_min_blocks: the fewest blocks (local window and routed, at the cap) a split attends.
    attn_tile_elements: elements of a split attention program's K (and V) tile: ``min(block_size, max(16, this //
        D))`` keys a tile.
    attn_warps, attn_stages: ``num_warps`` and ``num_stages`` of the split attention launch; attn_stages_wide its
        ``num_stages`` where a batch has more (request, KV head) rows than the GPU has multiprocessors.
    attn_maxnreg: registers a thread of a split attention program may use with ``attn_stages`` at head dim 128 (0:
        no cap): four programs a multiprocessor instead of two. The deeper ``attn_stages_wide`` pipeline's shared
        memory holds three programs a multiprocessor whatever their registers, and other head dims keep what the
        compiler gives them (64 takes fewer uncapped; 256 needs more).
    merge_thread_elements: the most elements of the merge program's ``[splits, D]`` fp32 tile a thread holds: its
        warps are the fewest that keep to it (one up to 32 splits at D 128), since each added warp adds exchanges
        between warps to the merge's reductions, on the chain of a small batch's step.
    fuse_write_max: the largest ``[block_size, D]`` key tile summarised inside the select launch (the K/V write
        and the summary of a block the new token completes go there); larger ones spill there and get a launch of
        their own.
    select_warps: ``num_warps`` of a select program (its cap's radix select runs only on tiles of at least one key
        a thread, and of at least ``routing.RADIX_MIN_KEYS``).
    select_tile_budget: elements of the select kernel's largest register tile (halved where a unit's score rows,
        padded to a power of two, are 16 or more).
    select_pivots: pivots a pass of the top-k cap's search where a unit's candidates do not fit one tile.
    one_tile_max: up to this many candidates the cap keeps every mp in registers.
    cap_rank_max: where the mp stay in registers, a unit with at most this many positive mp finds its ``topk``-th
        largest by ranking them, each against all (one per thread of the select program at the defaults); more take
        the radix select over every candidate.
    cap_rank_chunk: keys each thread compares its key with at a time while ranking.
    list_tile: width of the tiles in which the cap's ties pass and the compaction read a unit's list of positive mp.
    pdl: programmatic dependent launch where the GPU has it (``common.pdl_supported``): each launch of a step (the
        score launch too, after whatever kernel ran before the step) starts while the kernel before it ends, and
        waits for its results on the device.
    overlap_halves: where a batch has more (request, KV head) rows than the GPU has multiprocessors, the step runs
        as two half batches, the second half's launches on a second stream from the end of the first half's scores,
        so that its routing runs beside the first half's attention (``DecodeBuffers.halves``; a step with an
        indexer runs whole).
    """

    score_split_min_candidates: int = 64
    score_programs_per_sm: int = 4
    score_programs_per_sm_wide: int = 2
    score_block: int = 64
    score_stages: int = 3
    score_warps: int = 4
    attn_split_max: int = 64
    attn_programs_per_sm: int = 4
    attn_split_min_blocks: int = 2
    attn_tile_elements: int = 8192
    attn_warps: int = 4
    attn_stages: int = 2
    attn_stages_wide: int = 3
    attn_maxnreg: int = 128
    merge_thread_elements: int = 128
    fuse_write_max: int = 8192
    select_warps: int = 8
    select_tile_budget: int = 8192
    select_pivots: int = 16
    one_tile_max: int = 8192
    cap_rank_max: int = 256
    cap_rank_chunk: int = 32
    list_tile: int = 256
    pdl: bool = True
    overlap_halves: bool = True
