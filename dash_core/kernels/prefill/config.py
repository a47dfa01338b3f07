"""The prefill launches' tuning, as values: one frozen ``PrefillConfig`` passed to a call (through its
``PrefillWorkspace``, or to ``launch.paged_dash_prefill_triton``). The defaults are Hopper's; the Hopper-only paths
(TMA, the Gluon launch) check the hardware themselves and fall back elsewhere.

Every field changes speed only, never a result: the tests run the kernels under several configurations against
the oracle. The alternatives measured and not kept are in docs/tuning.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GluonConfig:
    """The Hopper attention launch (``gluon.prefill_attn_ws``): one persistent program a multiprocessor, each of
    its ``gluon.WARPGROUPS`` (3) warpgroups running a tile of its own.

    enabled: use it where ``gluon.ws_supported`` says it runs (else the Triton attention everywhere).
    k_slots, v_slots: K and V ring slots of a warpgroup.
    regs: registers a thread of each warpgroup (3 warpgroups x 128 threads x regs must fit the register file).
    min_candidates, min_tiles: the Gluon launch runs on block tables of at least ``min_candidates`` candidates, and
    on shorter ones in waves of at least ``min_tiles`` tiles (many short prompts in one call). Smaller waves keep the
    Triton attention: they are short, and the Gluon launch costs the host more a wave than it saves there.
    """

    enabled: bool = True
    k_slots: int = 1
    v_slots: int = 2
    regs: int = 168
    min_candidates: int = 256
    min_tiles: int = 256

    def wanted(self, max_cand: int, tiles: int) -> bool:
        """Whether a wave of ``tiles`` tiles over block tables of ``max_cand`` candidates takes the Gluon launch
        (where ``gluon.ws_supported`` says it runs)."""
        return self.enabled and (max_cand >= self.min_candidates or tiles >= self.min_tiles)


@dataclass(frozen=True)
class PrefillConfig:
    """Tuning of the prefill launches (routing scratch, tile sizes, warps, stages, paths).

    Scratch and waves:
        scratch_bytes: routing scratch of one wave (scores, mp, selection, union lists); keeps a 128k prompt's
            scratch under 1 GB. resident_ctas: programs of either launch resident on one multiprocessor (registers and
            shared memory allow 2 at D 128 on sm_90; waves are sized in whole rounds of them; 0: the budget alone).
            waves_last_first: issue a call's waves from its last: a prompt's first waves (short contexts) run in less
            time than the host takes to issue one. last_tiles_first: the route and attention launches (and the
            Gluon launch's work counter) take a wave's tiles from its last, a request's longest contexts first, so
            that short tiles fill the launch's tail (a short prompt is one wave: a triangle of tile lengths).
    Tiles:
        attn_rows: query rows of one tile (tokens x padded GQA group).
    Routing (``route.py``):
        route_tile_budget: elements of ``route_tile``'s largest register tile. route_registers: short block tables
            (every candidate in one ``[QT x G, candidates]`` tile of at most ``route_regs_budget`` elements, a
            quarter of it above D 128) route from the scores in registers, storing none
            (``route.scores_in_registers``); else through the score scratch. fuse_route: where the scores fit
            registers and the Triton kernel attends the wave, each attention program routes its own tile first, no
            route launch (``route.route_fused``). route_warps: warps of the route kernel with stored scores;
            route_regs_warps: its warps with the scores in registers (one tile a program: fewer warps, more programs
            a multiprocessor); route_stages: its pipeline stages on either path. route_score_tile:
            candidates of one stored-scores tile (half that above D 128). route_pivots, route_pivot_budget,
            route_list_budget: the top-k cap's pivot search (pivots per pass; elements of its ``[QT, pivots,
            entries]`` tile; of the ``[QT, entries]`` tiles of its ties and compaction passes).
    Routing from a summary copy (no score scratch; router ``kv_head`` on long block tables):
        recompute_min_candidates: the fewest candidates that route this way (half that from
        ``recompute_wide_group`` query heads per KV head); summary_copy_bytes: the most a call's copy may take.
        recompute_warps, recompute_stages, recompute_maxnreg (0: no register cap): that kernel's launch.
        copy_tma: its passes load the copy by TMA (Hopper and later), else by pointers.
    Attention (``attention.py``):
        attn_warps, attn_stages: warps and pipeline stages. attn_keys: keys of one union tile (a power of two).
        union_chunk: union block ids loaded at once for tiles of one block (the loop then computes K/V addresses
        from registers, so the pipeliner issues them ahead); union_chunk_gather: for tiles of several blocks (ids
        picked by ``tl.gather``, which with 32 ids hit an illegal address compiled with Triton 3.6: keep it at 16).
        attn_tma: union tiles of one block loaded by TMA (Hopper and later). union_tile, union_list_tile: elements
        of the union-building ``[TU, QT]`` and ``[QT, TJ]`` tiles. union_from_mp: where no cap binds and the
        routing stored every candidate's ``mp`` (short tables), a tile's union is built from them in one pass
        (``route.union_from_mp``), else from the tokens' kept lists.
    gluon: the Hopper attention launch (``GluonConfig``).
    """

    scratch_bytes: int = 896 << 20
    resident_ctas: int = 2
    waves_last_first: bool = True
    last_tiles_first: bool = True
    fuse_route: bool = True
    attn_rows: int = 64
    route_tile_budget: int = 4096
    route_registers: bool = True
    route_regs_budget: int = 8192
    route_warps: int = 8
    route_regs_warps: int = 4
    route_stages: int = 3
    route_score_tile: int = 64
    route_pivots: int = 4
    route_pivot_budget: int = 2048
    route_list_budget: int = 1024
    recompute_min_candidates: int = 256
    recompute_wide_group: int = 16
    summary_copy_bytes: int = 16 << 20
    recompute_warps: int = 4
    recompute_stages: int = 3
    recompute_maxnreg: int = 168
    copy_tma: bool = True
    attn_warps: int = 4
    attn_stages: int = 3
    attn_keys: int = 64
    union_chunk: int = 32
    union_chunk_gather: int = 16
    attn_tma: bool = True
    union_tile: int = 4096
    union_list_tile: int = 2048
    union_from_mp: bool = True
    gluon: GluonConfig = field(default_factory=GluonConfig)

    def __post_init__(self) -> None:
        if self.attn_rows & (self.attn_rows - 1) or self.attn_rows < 16:
            raise ValueError(f"PrefillConfig.attn_rows = {self.attn_rows}: expected a power of two >= 16")
        if self.attn_keys & (self.attn_keys - 1) or self.attn_keys < 16:
            raise ValueError(f"PrefillConfig.attn_keys = {self.attn_keys}: expected a power of two >= 16")
        if self.scratch_bytes <= 0:
            raise ValueError(f"PrefillConfig.scratch_bytes = {self.scratch_bytes}: expected > 0")

    def union_keys(self, d: int, bs: int) -> int:
        """Keys of one union tile of the Triton attention at head dim ``d``, block size ``bs``."""
        return self.attn_keys if d <= 128 else min(bs, 32)

    def union_in_one_block(self, d: int, bs: int) -> bool:
        """Whether a union tile (``union_keys``) lies within one block: one base address, no gather."""
        return self.union_keys(d, bs) < 2 * bs

    def gluon_wanted(self, d: int, bs: int, max_cand: int, tiles: int) -> bool:
        """Whether the Gluon launch is wanted for a wave of ``tiles`` tiles over tables of ``max_cand`` candidates
        (``GluonConfig.wanted``, union tiles within one block); ``gluon.attends`` adds where it can run."""
        return self.union_in_one_block(d, bs) and self.gluon.wanted(max_cand, tiles)

