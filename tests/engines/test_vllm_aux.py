"""``LLM(...)`` end to end with the auxiliary head (docs/semantics.md section 9): a tiny DASH Llama with an
indexer and page mode, and one with an indexer only, against the torch reference model.

- indexer + page mode: prompts with pages (adjacent pages, text between pages, a question after the
  last page) and without any page, batched so that some steps mix decodes with a fresh prefill;
  the greedy tokens and their log-probabilities equal ``tests.tiny_dash_llama.reference_generate``,
  and every layer's cache has ``Hkv + 1`` head slots (the auxiliary head, counted by vLLM);
- indexer only: prefix caching and chunked prefill stay on (the indexer keys and their one-head
  summaries live in the pages), same comparison;
- page mode with chunked prefill or prefix caching on fails at start-up, naming the flags;
- indexer + page mode in a multi-process TP 2 engine (each rank: one KV head + its auxiliary head).

Plain DASH models are covered, unchanged, by test_vllm_engine.py.
"""

from __future__ import annotations

import gc
import os

import pytest

pytest.importorskip("vllm")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default would reserve most of RAM)

import torch

from tests.engines import _vllm_support as support
from tests.tiny_dash_llama import DEFAULTS, reference_generate, write_checkpoint

pytestmark = pytest.mark.engine_vllm
_budget = support.budget("aux-head", 300)

BS, HI = 16, 2
SPARSE = dict(chunk_size=BS, scaling_factor=2.0, dash_topk=2)
START, PAGE = DEFAULTS["vocab_size"] - 2, DEFAULTS["vocab_size"] - 1  # the checkpoint's placeholder ids
# Log-probabilities: fp32 engine vs float64 reference model, as in test_vllm_engine.py (measured max
# 1e-5 here); a routing or coordinate difference moves them by ~1e-1.
ATOL = 2e-4


def _text(n: int, seed: int) -> list:
    return torch.randint(3, START, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _page(n: int) -> list:
    return [START] + [PAGE] * (n - 1)


# (prompt, new tokens): text + 2 pages + question; adjacent pages; text between pages and a page
# that ends the prompt; no page at all (ordinary RoPE by construction); a long multi-page prompt.
PROMPTS = [
    (_text(5, 1) + _page(20) + _page(31) + _text(10, 2), 8),
    (_page(17) + _page(16) + _page(5) + _text(3, 3), 5),
    (_text(7, 4) + _page(12) + _text(9, 5) + _page(40), 3),
    (_text(40, 6), 6),
    (_text(3, 7) + _page(64) + _text(20, 8) + _page(33) + _page(48) + _text(30, 9), 4),
]


def _engine(path: str, **kw):
    from vllm import LLM

    args = dict(model=path, load_format="safetensors", skip_tokenizer_init=True, dtype="float32",
                max_model_len=512, max_num_seqs=2, max_num_batched_tokens=512, enforce_eager=True, seed=0,
                block_size=BS, enable_prefix_caching=False, enable_chunked_prefill=False)
    args.update(kw)
    return LLM(**args)


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _generate(llm, prompts) -> list:
    """Greedy generation of ``(prompt, max_tokens)`` pairs in one call: (tokens, log-probabilities)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sps = [SamplingParams(temperature=0, max_tokens=n, logprobs=1, ignore_eos=True, detokenize=False)
           for _, n in prompts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in prompts], sps, use_tqdm=False)
    return [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            for c in (o.outputs[0] for o in outs)]


def _check_against_reference(path: str, prompts, got) -> None:
    for (prompt, n), (tok, lp) in zip(prompts, got):
        want_tok, want_lp = reference_generate(path, prompt, n)
        assert tok == want_tok, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), torch.tensor(want_lp, dtype=torch.float64),
                                   atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def page_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dash_llama_pages"))
    support.check_free_disk(path)
    write_checkpoint(path, indexer_heads=HI, page_mode=True, **SPARSE)
    return path


def test_indexer_and_page_mode_generation_matches_the_reference_model(page_checkpoint):
    """Two sequences at a time over five prompts of different lengths: later prompts are prefilled in
    steps that also decode the earlier ones (decode and prefill rows in one batch)."""
    llm = _engine(page_checkpoint)
    try:
        got = _generate(llm, PROMPTS)
        (stats,) = llm.apply_model(support.dash_stats)
        (shapes,) = llm.apply_model(support.dash_kv_cache_shapes)
    finally:
        _close(llm)
    assert stats["decode_tokens"] > 0 and stats["prefill_tokens"] == 2 * sum(len(p) for p, _ in PROMPTS)
    # Every layer: [blocks, Hkv + 1, block size, 2D]; head slot Hkv is the auxiliary head.
    hkv, d = DEFAULTS["num_key_value_heads"], DEFAULTS["head_dim"]
    assert len(shapes) == 2 and all(s[1:] == (hkv + 1, BS, 2 * d) for s in shapes)
    _check_against_reference(page_checkpoint, PROMPTS, got)


def test_indexer_model_with_prefix_caching_and_chunked_prefill(tmp_path):
    """Indexer only (no page mode): prompts are split by a 64-token budget and the later call hits
    the pages of the earlier one; the stored indexer keys and summaries serve both."""
    path = str(tmp_path)
    write_checkpoint(path, indexer_heads=HI, **SPARSE)
    base = _text(150, 11)
    calls = [[(base[:37], 6), (base, 6)], [(base[:120] + _text(9, 12), 6)]]
    llm = _engine(path, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True,
                  enable_chunked_prefill=True)
    try:
        got = [r for c in calls for r in _generate(llm, c)]
        (stats,) = llm.apply_model(support.dash_stats)
    finally:
        _close(llm)
    # Prefix hits: fewer prompt tokens computed than prompted (150 + 37 + 129 = 316 per layer).
    assert 0 < stats["prefill_tokens"] < 2 * 316
    _check_against_reference(path, [p for c in calls for p in c], got)


@pytest.mark.parametrize("flags,match", [
    (dict(enable_chunked_prefill=True), "--no-enable-chunked-prefill"),
    (dict(enable_prefix_caching=True), "--no-enable-prefix-caching"),
])
def test_page_mode_refuses_chunked_prefill_and_prefix_caching(page_checkpoint, flags, match):
    with pytest.raises(ValueError, match=f"page-mode model must prefill every prompt in one chunk.*{match}"):
        _engine(page_checkpoint, **flags)


def test_indexer_and_page_mode_under_real_tensor_parallel_2(page_checkpoint, tmp_path):
    """A multi-process TP 2 engine (engine core + one worker per rank): each rank keeps one KV head plus
    its own auxiliary head and computes the replicated indexer; tokens equal the reference model's.
    ``DASH_ATTENTION_BACKEND`` set for the engine reaches every layer of both worker processes."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP 2 on the CPU needs two cores (vLLM binds one per rank)")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[1]}",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", DASH_ATTENTION_BACKEND="FLASH_ATTN",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    engine = dict(model=page_checkpoint, load_format="safetensors", skip_tokenizer_init=True, dtype="float32",
                  max_model_len=512, max_num_seqs=2, max_num_batched_tokens=512, enforce_eager=True, seed=0,
                  block_size=BS, enable_prefix_caching=False, enable_chunked_prefill=False, tensor_parallel_size=2)
    prompts = [PROMPTS[0], PROMPTS[3]]
    new = 6
    got = support.generate_in_subprocess(engine, [p for p, _ in prompts], new, str(tmp_path / "tp2.json"), env,
                                         timeout=400)
    assert len(got["stats"]) == 2 and all(s["forwards"] > 0 and s["decode_tokens"] > 0 for s in got["stats"])
    assert got["attention_backends"] == [["FLASH_ATTN"] * 2] * 2  # 2 ranks x 2 layers (CPU: PyTorch path)
    _check_against_reference(page_checkpoint, [(p, new) for p, _ in prompts], [tuple(r) for r in got["results"]])
