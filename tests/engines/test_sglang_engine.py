"""``sgl.Engine(..., attention_backend="dash")`` end to end on the CPU with a tiny random DASH Llama.

- Dense-equivalent checkpoint (docs/semantics.md section 1): DASH's prompt and generated-token
  log-probabilities and tokens equal SGLang's own dense backend (``torch_native``) on the same model,
  and the plain PyTorch reference forward.
- Sparse checkpoint (topk 2, 16-token blocks, prompts of up to 9 blocks), with chunked prefill
  (``chunked_prefill_size=32``: every long prompt is an extend over paged history) and the radix
  cache: log-probabilities and greedy tokens equal the lead's reference forward that calls the
  oracle; a prompt sharing a cached prefix reuses its pages (and their summaries) and still equals
  the reference; the batches the engine handed to the ops are consistent (and are the source of the
  GPU replay fixtures); a too-long prompt is refused and the engine keeps serving.

The page-size start-up error is tested with the HTTP server (test_sglang_server.py): a failed
``sgl.Engine`` start kills its host process (SGLang's SIGQUIT handler), so it needs a process of its own.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

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
    write_tiny_checkpoint,
)
from tests.engines._sglang_support import ref_prompt_logprobs as _ref_prompt_logprobs
from tests.tiny_dash_llama import reference_generate

_budget = budget("engine", 330)

# float32 engine against the float64 reference through 2 layers with weights of scale 0.25: measured
# differences are about 5e-5 in log-probability; 2e-3 keeps a 40x margin and is far below the
# differences between the dense and sparse configurations (asserted > 0.05 below).
LOGPROB_TOL = 2e-3
# Two float32 engines on the same weights, differing only in the attention kernel (SDPA vs DASH's
# float64 path cast to float32): measured about 1e-5.
ENGINE_TOL = 5e-4
NEW_TOKENS = 4
PROMPTS = [prompt(100, seed=1), prompt(37, seed=2), prompt(16, seed=3)]


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sglang") / "dense_equivalent")
    write_tiny_checkpoint(path, chunk_size=16, scaling_factor=0.0, estimate_diagonal=True)
    return path


@pytest.fixture(scope="module")
def sparse_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sglang") / "sparse")
    write_tiny_checkpoint(path, chunk_size=16, scaling_factor=4.0, dash_topk=2)
    return path


def test_dense_equivalent_matches_torch_native_and_reference(dense_ckpt):
    runs = {}
    for backend in ("dash", "torch_native"):
        # SGLang's dense backend on a DASH checkpoint: the comparison DASH_ALLOW_DENSE exists for
        with environment(DASH_ALLOW_DENSE="1" if backend != "dash" else "0"), \
                engine(dense_ckpt, attention_backend=backend) as eng:
            runs[backend] = generate(eng, PROMPTS, NEW_TOKENS)
            assert eng.get_server_info()["attention_backend"] == backend
    for ids, d, n in zip(PROMPTS, runs["dash"], runs["torch_native"]):
        assert d["output_ids"] == n["output_ids"]
        assert max_diff(prompt_logprobs(d), prompt_logprobs(n)) < ENGINE_TOL
        assert max_diff(output_logprobs(d), output_logprobs(n)) < ENGINE_TOL
        assert max_diff(prompt_logprobs(d), _ref_prompt_logprobs(dense_ckpt, ids, dense=True)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def sparse_engine(sparse_ckpt, tmp_path_factory):
    """One sparse DASH engine for the tests below; its op calls are recorded (``DASH_RECORD_DIR``)."""
    record_dir = str(tmp_path_factory.mktemp("batches"))
    with environment(DASH_RECORD_DIR=record_dir, DASH_RECORD_MAX="400"):  # read by the scheduler process
        with engine(sparse_ckpt, chunked_prefill_size=32, context_length=256) as eng:
            eng.record_dir = record_dir
            yield eng


def test_sparse_matches_reference_forward(sparse_engine, sparse_ckpt):
    results = generate(sparse_engine, PROMPTS, NEW_TOKENS)
    dense_gap = 0.0
    for ids, r in zip(PROMPTS, results):
        ref = _ref_prompt_logprobs(sparse_ckpt, ids)
        assert max_diff(prompt_logprobs(r), ref) < LOGPROB_TOL
        dense_gap = max(dense_gap, max_diff(ref, _ref_prompt_logprobs(sparse_ckpt, ids, dense=True)))
        new, lps = reference_generate(sparse_ckpt, ids, NEW_TOKENS)
        assert r["output_ids"] == new
        assert max_diff(output_logprobs(r), lps) < LOGPROB_TOL
    assert dense_gap > 0.05  # the sparse configuration really routes (it differs from dense attention)


def test_prefix_cache_reuses_pages_and_summaries(sparse_engine, sparse_ckpt):
    """A prompt sharing 80 tokens (5 pages) with a finished one hits the radix cache and equals the oracle.

    The new tokens' queries route over summaries of the cached pages written by the first request.
    """
    base = prompt(90, seed=5)
    generate(sparse_engine, [base], 1, with_prompt_logprobs=False)
    shared = base[:80] + prompt(30, seed=6)
    (r,) = generate(sparse_engine, [shared], NEW_TOKENS, with_prompt_logprobs=False)
    assert r["meta_info"]["cached_tokens"] >= 64  # whole pages of the shared prefix came from the cache
    new, lps = reference_generate(sparse_ckpt, shared, NEW_TOKENS)
    assert r["output_ids"] == new and max_diff(output_logprobs(r), lps) < LOGPROB_TOL


def test_prompt_longer_than_context_is_refused_and_engine_keeps_serving(sparse_engine, sparse_ckpt):
    too_long = prompt(300, seed=7)  # the engine runs with context_length=256
    try:
        out = sparse_engine.generate(input_ids=too_long, sampling_params={"max_new_tokens": 2, "temperature": 0})
    except Exception as e:
        message = str(e)
    else:
        message = str(out.get("meta_info", {}).get("finish_reason"))
    assert "context length" in message or "longer than" in message, message
    (r,) = generate(sparse_engine, [PROMPTS[1]], NEW_TOKENS)
    assert r["output_ids"] == reference_generate(sparse_ckpt, PROMPTS[1], NEW_TOKENS)[0]


def test_recorded_batches_are_consistent(sparse_engine):
    """The batches SGLang handed to the ops: chunked prefills over paged history and decodes, whose slot
    mapping is exactly what the block table (from req_to_token) says. They become the GPU replay fixtures."""
    from dash_core.recorder import load_batches

    batches = load_batches(os.path.join(sparse_engine.record_dir, "*.pt"))  # sorted by file name = call order
    assert batches, "DASH_RECORD_DIR produced no batches"
    ops = {b["op"] for b in batches}
    assert ops == {"prefill", "decode"}
    chunked = 0
    for b in batches:
        ps, cu, lens, bt, slots = b["page_size"], b["cu_seqlens_q"], b["seq_lens"], b["block_table"], b["slot_mapping"]
        assert ps == 16 and b["params"]["block_size"] == 16 and b["has_summaries"]
        for i in range(lens.numel()):
            q_len = int(cu[i + 1] - cu[i])
            pos = torch.arange(int(lens[i]) - q_len, int(lens[i]))
            want = bt[i, pos // ps].long() * ps + pos % ps
            assert torch.equal(slots[int(cu[i]):int(cu[i + 1])], want)
            chunked += b["op"] == "prefill" and int(lens[i]) > q_len
    assert chunked > 0  # some extend ran over paged history (chunked prefill or a prefix-cache hit)
    save = os.environ.get("DASH_SGLANG_SAVE_BATCHES")
    if save:  # refresh tests/fixtures/engine_batches/sglang (see its README)
        _save_distinct(sorted(glob.glob(os.path.join(sparse_engine.record_dir, "*.pt"))), batches, save)


def _save_distinct(paths, batches, out_dir):
    """Copy the batches to ``out_dir`` as ``NN_<op>.pt``, skipping a batch equal to the previous one
    (each forward calls the op once per layer with the same metadata)."""
    os.makedirs(out_dir, exist_ok=True)
    prev, n = None, 0
    for path, b in zip(paths, batches):
        key = [b["op"]] + [b[k].tolist() for k in ("block_table", "cu_seqlens_q", "seq_lens", "slot_mapping")]
        if key != prev:
            shutil.copy(path, os.path.join(out_dir, f"{n:02d}_{b['op']}.pt"))
            n += 1
        prev = key
