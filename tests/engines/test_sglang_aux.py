"""``sgl.Engine`` with DASH models that use the auxiliary head (docs/semantics.md section 9), and the attention-stage
backend option, end to end on the CPU against ``tests/tiny_dash_llama``'s reference forward.

- An indexer + page-mode model (2 indexer heads, topk 2, 16-token blocks), prompts in one chunk
  (``--chunked-prefill-size -1``, as page mode requires): prompts with several pages, adjacent pages,
  text between them and a question after them, and a prompt without pages, batched together; prompt
  and generated-token log-probabilities and greedy tokens equal ``reference_logprobs`` /
  ``reference_generate``, which differ from the same model without page RoPE (so the page coordinates
  really reach the op). A second request repeating a prompt's pages with another question hits the
  radix cache (the documented exact case) and still equals the reference.
- An indexer-only model with chunked prefill (the model rotates iq/ik itself): equal to the reference.
- The attention-stage backend chosen with ``DASH_ATTENTION_BACKEND`` (read once by the backend in the
  scheduler process SGLang spawns) shows in the ``DashParams`` of the recorded op calls; on the CPU the
  result is the PyTorch path's.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from tests.engines._sglang_support import (
    budget,
    engine,
    environment,
    generate,
    max_diff,
    output_logprobs,
    prompt,
    prompt_logprobs,
    ref_prompt_logprobs,
    write_tiny_checkpoint,
)
from tests.tiny_dash_llama import PAGE_START_TOKEN_ID, PAGE_TOKEN_ID, reference_generate

_budget = budget("aux", 360)

# As test_sglang_engine.py: a float32 engine against the float64 reference through 2 layers measures about
# 5e-5 in log-probability; 2e-3 keeps a 40x margin.
LOGPROB_TOL = 2e-3
NEW_TOKENS = 4
# Page mode prefills a prompt in one chunk (--chunked-prefill-size -1). SGLang then reserves activation memory
# for max_prefill_tokens (default 16384: more than this machine has); these prompts are far shorter.
ONE_CHUNK = dict(chunked_prefill_size=-1, max_prefill_tokens=2048)


def _page(n: int) -> list:
    """One document page of ``n`` placeholder tokens: a page start, then page tokens."""
    return [PAGE_START_TOKEN_ID] + [PAGE_TOKEN_ID] * (n - 1)


# Several pages with text before, between and after them (the question); adjacent pages; no page at all.
PAGE_PROMPTS = [
    prompt(9, seed=21) + _page(20) + prompt(5, seed=22) + _page(27) + prompt(14, seed=23),
    _page(18) + _page(18) + _page(9) + prompt(20, seed=24),
    prompt(45, seed=25),
]


@pytest.fixture(scope="module")
def page_engine(tmp_path_factory):
    """An indexer + page-mode model; DASH_ATTENTION_BACKEND set and the op calls recorded."""
    path = str(tmp_path_factory.mktemp("sglang_aux") / "indexer_page")
    write_tiny_checkpoint(path, chunk_size=16, scaling_factor=4.0, dash_topk=2, indexer_heads=2, page_mode=True)
    record_dir = str(tmp_path_factory.mktemp("aux_batches"))
    with environment(DASH_ATTENTION_BACKEND="flashinfer", DASH_RECORD_DIR=record_dir, DASH_RECORD_MAX="8"):
        with engine(path, **ONE_CHUNK) as eng:
            eng.path, eng.record_dir = path, record_dir
            yield eng


def test_indexer_page_mode_matches_reference(page_engine):
    import json

    results = generate(page_engine, PAGE_PROMPTS, NEW_TOKENS)
    with open(os.path.join(page_engine.path, "config.json")) as f:
        cfg = json.load(f)
    plain = {k: v for k, v in cfg.items() if k != "dash_page_mode"}  # the same weights without page RoPE
    plain_path = page_engine.path + "_no_page_mode"
    os.makedirs(plain_path, exist_ok=True)
    os.symlink(os.path.join(page_engine.path, "model.safetensors"), os.path.join(plain_path, "model.safetensors"))
    with open(os.path.join(plain_path, "config.json"), "w") as f:
        json.dump(plain, f)
    page_gap = 0.0
    for ids, r in zip(PAGE_PROMPTS, results):
        ref = ref_prompt_logprobs(page_engine.path, ids)
        assert max_diff(prompt_logprobs(r), ref) < LOGPROB_TOL
        new, lps = reference_generate(page_engine.path, ids, NEW_TOKENS)
        assert r["output_ids"] == new
        assert max_diff(output_logprobs(r), lps) < LOGPROB_TOL
        page_gap = max(page_gap, max_diff(ref, ref_prompt_logprobs(plain_path, ids)))
    assert page_gap > 0.05  # page RoPE changes the answer: the engine's coordinates are not ordinary positions


def test_page_mode_prefix_cache_hit_with_another_question(page_engine):
    """The same text and pages with another question: the cached prefix ends inside the last page of the
    prompt that wrote it, so its stored coordinates are the new prompt's (the exact case, docs/sglang.md)."""
    pages = prompt(6, seed=30) + _page(24) + _page(24) + _page(24)
    generate(page_engine, [pages + prompt(10, seed=31)], 1, with_prompt_logprobs=False)
    ids = pages + prompt(12, seed=32)
    (r,) = generate(page_engine, [ids], NEW_TOKENS, with_prompt_logprobs=False)
    assert r["meta_info"]["cached_tokens"] >= 64  # whole pages of the shared prefix came from the radix cache
    new, lps = reference_generate(page_engine.path, ids, NEW_TOKENS)
    assert r["output_ids"] == new and max_diff(output_logprobs(r), lps) < LOGPROB_TOL


def test_page_mode_prefix_hit_from_a_prompt_with_more_pages(page_engine):
    """A one-page prompt whose first page is cached from a three-page prompt (equal placeholder ids)."""
    generate(page_engine, [_page(20) + _page(20) + _page(20) + prompt(8, seed=33)], 1, with_prompt_logprobs=False)
    ids = _page(20) + prompt(10, seed=34)
    (r,) = generate(page_engine, [ids], NEW_TOKENS, with_prompt_logprobs=False)
    assert r["meta_info"]["cached_tokens"] >= 16
    new, lps = reference_generate(page_engine.path, ids, NEW_TOKENS)
    assert r["output_ids"] == new and max_diff(output_logprobs(r), lps) < LOGPROB_TOL


def test_attention_backend_env_reaches_dash_params_in_the_engine(page_engine):
    """Run after a generate: DASH_ATTENTION_BACKEND=flashinfer reached the scheduler's DashParams."""
    from dash_core.recorder import load_batches

    if not os.listdir(page_engine.record_dir):
        generate(page_engine, [PAGE_PROMPTS[2]], 1)
    batches = load_batches(os.path.join(page_engine.record_dir, "*.pt"))
    assert batches and {b["params"]["attention_backend"] for b in batches} == {"FLASHINFER"}
    assert {b["params"]["topk"] for b in batches} == {2}  # the rest of DashParams still comes from the config
    # The recorded caches carry the 1-head summary store of an indexer model.
    assert all(b["has_summaries"] for b in batches)


def test_indexer_model_with_chunked_prefill_matches_reference(tmp_path_factory):
    """Without page mode the model rotates iq/ik itself; chunked prefill (32-token chunks) is allowed."""
    path = str(tmp_path_factory.mktemp("sglang_aux") / "indexer")
    write_tiny_checkpoint(path, chunk_size=16, scaling_factor=4.0, dash_topk=2, indexer_heads=2)
    prompts = [prompt(100, seed=41), prompt(37, seed=42)]
    with engine(path, chunked_prefill_size=32) as eng:
        results = generate(eng, prompts, NEW_TOKENS)
    for ids, r in zip(prompts, results):
        assert max_diff(prompt_logprobs(r), ref_prompt_logprobs(path, ids)) < LOGPROB_TOL
        new, lps = reference_generate(path, ids, NEW_TOKENS)
        assert r["output_ids"] == new and max_diff(output_logprobs(r), lps) < LOGPROB_TOL
