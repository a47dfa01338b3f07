"""``LLM(...)`` end to end on the CPU build of vLLM with a tiny random DASH Llama checkpoint.

- dense-equivalent DASH (``dash_*`` overrides of the published keys) against vLLM's own dense
  ``CPU_ATTN`` on the same weights: equal tokens, equal log-probabilities;
- the sparse configuration against the oracle: per layer, the engine's attention outputs equal
  ``dash_reference`` on the engine's own q/k/v (captured with hooks), and the greedy tokens equal
  those of the plain PyTorch model that calls the oracle (``tests.tiny_dash_llama``);
- prefix caching and chunked prefill are on throughout (prompts share prefixes across calls, the
  token budget splits long prompts), and the DASH counters prove which backend ran;
- bad input: a block size that does not fit fails at start-up with the SPEC's message; a prompt
  longer than the model's maximum is refused and the engine keeps serving.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before the first engine:
vLLM caches its environment then); the multi-process engine is covered by the TP 2 test.
"""

from __future__ import annotations

import gc
import os

import pytest

pytest.importorskip("vllm")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default would reserve most of RAM)

import torch

from dash_core import DashParams, dash_reference

from tests.engines import _vllm_support as support
from tests.tiny_dash_llama import load, reference_generate, write_checkpoint

pytestmark = pytest.mark.engine_vllm
_budget = support.budget("engine", 240)

BS = 16
CHECKPOINT = dict(chunk_size=BS, scaling_factor=2.0, dash_topk=2)  # sparse by default
DENSE_EQUIVALENT = {"dash_scaling_factor": 0.0, "dash_estimate_diagonal": True, "dash_topk": None}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dash_llama"))
    support.check_free_disk(path)
    write_checkpoint(path, **CHECKPOINT)
    return path


def _prompts():
    """Calls of generate, in order: the later calls hit the prefix cache of the earlier ones."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, 500, (150,), generator=g).tolist()
    return [[base[:5], base[:37], base], [base[:100] + [7, 8, 9, 10, 11]], [base]]


def _generate(llm, calls, max_tokens=NEW_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True, detokenize=False)
    results = []
    for prompts in calls:
        for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False):
            c = out.outputs[0]
            results.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return results


def _engine(checkpoint, **kw):
    from vllm import LLM

    args = dict(model=checkpoint, load_format="safetensors", skip_tokenizer_init=True, dtype="float32",
                max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True, seed=0,
                block_size=BS, enable_prefix_caching=True, enable_chunked_prefill=True)
    args.update(kw)
    return LLM(**args)


def _close(llm):
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory):
    """Where the sparse engine's batches are recorded (``DASH_RECORD_DIR``, read at every op call)."""
    return str(tmp_path_factory.mktemp("batches"))


@pytest.fixture(scope="module")
def sparse_engine(checkpoint, record_dir):
    old = {k: os.environ.get(k) for k in ("DASH_RECORD_DIR", "DASH_RECORD_MAX")}
    os.environ.update(DASH_RECORD_DIR=record_dir, DASH_RECORD_MAX="400")
    llm = _engine(checkpoint)
    yield llm
    _close(llm)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_dense_equivalent_matches_the_engines_dense_backend(checkpoint, monkeypatch):
    monkeypatch.delenv("DASH_ALLOW_DENSE", raising=False)
    dash = _engine(checkpoint, hf_overrides=DENSE_EQUIVALENT)
    try:
        got = _generate(dash, _prompts())
        (stats,) = dash.apply_model(support.dash_stats)
    finally:
        _close(dash)
    # vLLM's dense backend on a DASH checkpoint: the comparison DASH_ALLOW_DENSE exists for
    monkeypatch.setenv("DASH_ALLOW_DENSE", "1")
    dense = _engine(checkpoint, attention_backend="CPU_ATTN", block_size=32)  # CPU_ATTN needs multiples of 32
    try:
        want = _generate(dense, _prompts())
        (dense_stats,) = dense.apply_model(support.dash_stats)
    finally:
        _close(dense)
    # The DASH backend ran every attention call (decode and prefill rows; 2 layers), the dense one none.
    assert stats["forwards"] > 0 and stats["decode_tokens"] > 0 and stats["prefill_tokens"] > 0
    assert dense_stats["forwards"] == 0
    for (tok, lp), (tok_d, lp_d) in zip(got, want):
        assert tok == tok_d
        # Both run the model in fp32 and differ only in the attention's summation order (the paged
        # DASH path accumulates in float64): measured max |diff| 8e-6 on logprobs of magnitude ~1.
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_d), atol=2e-4, rtol=0)


def test_sparse_generation_matches_the_oracle_model(checkpoint, sparse_engine):
    params = DashParams.from_config(CHECKPOINT)
    before = sparse_engine.apply_model(support.dash_stats)[0]
    calls = _prompts()
    got = _generate(sparse_engine, calls)
    after = sparse_engine.apply_model(support.dash_stats)[0]
    assert after["decode_tokens"] > before["decode_tokens"] and after["prefill_tokens"] > before["prefill_tokens"]
    prompts = [p for c in calls for p in c]
    for prompt, (tok, lp) in zip(prompts, got):
        want_tok, want_lp = reference_generate(checkpoint, prompt, NEW_TOKENS, params=params)
        assert tok == want_tok, f"prompt of {len(prompt)} tokens"
        # fp32 engine vs float64 reference model: the log-probabilities differ by the fp32 rounding of
        # the whole forward (measured max 4e-5); a routing difference would move them by ~1e-1.
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), torch.tensor(want_lp, dtype=torch.float64),
                                   atol=2e-4, rtol=0)


def test_recorded_batches_are_consistent(sparse_engine, record_dir):
    """The batches vLLM handed to the attention ops during the sparse generation: decodes, chunked
    prefills and prefix-cache hits (extends over paged history), each row's pages real blocks (never
    vLLM's null block 0) and the pages of one step's requests distinct except for shared prefixes.
    The ops write their K/V (``forward_includes_kv_cache_update``): each query token's slot is on its row's page
    at its position.
    ``DASH_VLLM_SAVE_BATCHES=DIR`` copies them (one per engine step: both layers see the same
    batch) for GPU replay (tests/fixtures/engine_batches/vllm, see its README)."""
    import glob
    import shutil

    from dash_core.recorder import load_batches

    files = sorted(glob.glob(os.path.join(record_dir, "*.pt")))
    batches = load_batches(os.path.join(record_dir, "*.pt"))
    assert {b["op"] for b in batches} == {"prefill", "decode"}
    extends = 0
    for b in batches:
        ps, cu, lens, bt = b["page_size"], b["cu_seqlens_q"], b["seq_lens"], b["block_table"]
        assert ps == BS and b["params"]["block_size"] == BS and b["has_summaries"]
        sm = b["slot_mapping"]
        assert sm is not None and sm.shape[0] >= int(cu[-1])
        owners = {}
        for i in range(lens.numel()):
            q_len, n = int(cu[i + 1] - cu[i]), int(lens[i])
            assert 0 < q_len <= n and (b["op"] == "prefill" or q_len == 1)
            pages = bt[i, : -(-n // ps)].tolist()
            want = [pages[pos // ps] * ps + pos % ps for pos in range(n - q_len, n)]
            assert sm[int(cu[i]): int(cu[i + 1])].tolist() == want
            assert 0 not in pages and max(pages) < b["num_pages"] and len(set(pages)) == len(pages)
            for j, page in enumerate(pages):  # a page shared by two rows holds the same prefix block in both
                assert owners.setdefault(page, j) == j
            extends += b["op"] == "prefill" and n > q_len
    assert extends > 0
    save = os.environ.get("DASH_VLLM_SAVE_BATCHES")
    if save:
        os.makedirs(save, exist_ok=True)
        previous = None
        for path, b in zip(files, batches):
            key = repr({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()})
            if key != previous:
                shutil.copy(path, save)
            previous = key


def test_per_layer_outputs_equal_the_oracle_on_the_engines_qkv(checkpoint, sparse_engine):
    """Hooks capture each layer's q, k, v and output for one fresh prompt (a prefill in several
    chunks, then decodes); the oracle on the captured q/k/v must give the captured output."""
    cfg, sd = load(checkpoint)
    params = DashParams.from_config(cfg)
    hkv, d, hq = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_attention_heads"]
    prompt = [499] + torch.randint(3, 500, (140,), generator=torch.Generator().manual_seed(5)).tolist()
    sparse_engine.apply_model(support.capture_attention)
    try:
        _generate(sparse_engine, [[prompt]])
    finally:
        (calls,) = sparse_engine.apply_model(support.release_attention)
    length = len(prompt) + NEW_TOKENS - 1
    for layer in range(cfg["num_hidden_layers"]):
        name = f"model.layers.{layer}.self_attn.attn"
        mine = [c for c in calls if c[0] == name]
        assert len(mine) > 3  # chunked prefill (budget 64) and decodes
        q, k, v, out = (torch.cat([c[i] for c in mine]) for i in range(1, 5))
        assert q.shape[0] == length
        head_cls = sd[f"model.layers.{layer}.self_attn.indexer_q"].view(hkv, d).float()
        q4, k4, v4 = (x.view(length, -1, d).permute(1, 0, 2)[None] for x in (q, k, v))
        ref, active = dash_reference(q4, k4, v4, head_cls, params)
        # Same fp32 inputs, same float64 math and fp32-rounded summaries on both sides.
        torch.testing.assert_close(out.view(length, hq, d), ref[0].permute(1, 0, 2), atol=1e-5, rtol=0)
        # And the configuration is sparse: late rows attend to fewer blocks than they could.
        assert active[0, :, -1].max().item() < length // params.block_size


def test_real_tensor_parallel_2_engine_on_the_cpu(checkpoint, sparse_engine, tmp_path):
    """A multi-process TP 2 engine (engine core + one worker per rank, each loading the plugin):
    each rank runs DASH on its KV head, and the result equals the single-rank engine's."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP 2 on the CPU needs two cores (vLLM binds one per rank)")
    # apply_model ships a function to the workers: vLLM's msgpack channel needs pickle allowed for that.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[1]}",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    engine = dict(model=checkpoint, load_format="safetensors", skip_tokenizer_init=True, dtype="float32",
                  max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True, seed=0,
                  block_size=BS, enable_prefix_caching=True, enable_chunked_prefill=True, tensor_parallel_size=2)
    prompts = _prompts()[0]
    got = support.generate_in_subprocess(engine, prompts, NEW_TOKENS, str(tmp_path / "tp2.json"), env, timeout=400)
    assert len(got["stats"]) == 2 and all(s["forwards"] > 0 and s["decode_tokens"] > 0 for s in got["stats"])
    want = _generate(sparse_engine, [prompts])
    for (tok, lp), (tok1, lp1) in zip(got["results"], want):
        assert tok == tok1
        # TP splits the o_proj / MLP reductions across ranks: fp32 reassociation only.
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp1), atol=2e-4, rtol=0)


def test_prompt_longer_than_the_maximum_is_refused_and_the_engine_keeps_serving(checkpoint, sparse_engine):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="maximum context length is 512"):
        _generate(sparse_engine, [[list(range(3, 3 + 600))]])
    prompt = list(range(3, 40))
    ((tok, lp),) = _generate(sparse_engine, [[prompt]], max_tokens=4)
    want_tok, want_lp = reference_generate(checkpoint, prompt, 4, params=DashParams.from_config(CHECKPOINT))
    assert tok == want_tok  # the next request is served as the oracle model serves it (tolerance: as above)
    torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), torch.tensor(want_lp, dtype=torch.float64),
                               atol=2e-4, rtol=0)


def test_block_size_that_does_not_fit_fails_at_start_up(checkpoint):
    with pytest.raises(ValueError, match=r"page size must be a multiple of the DASH block size.*--block-size 16"):
        _engine(checkpoint, block_size=32)


def test_checkpoint_without_the_dash_weight_fails_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    write_checkpoint(path, **CHECKPOINT)
    sd = load_file(f"{path}/model.safetensors")
    for name in [n for n in sd if n.endswith("self_attn.indexer_q")]:
        del sd[name]
    save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no DASH weight for 2 layer\(s\).*self_attn\.indexer_q"):
        _engine(path)


def test_attention_backend_option_reaches_the_engines_layers(checkpoint, monkeypatch):
    """``DASH_ATTENTION_BACKEND`` set when the engine starts is in every DASH layer's DashParams (the
    builders take theirs from the layers); the CPU runs the PyTorch path whatever the backend, so the
    tokens stay the oracle model's."""
    monkeypatch.setenv("DASH_ATTENTION_BACKEND", "FLASHINFER")
    llm = _engine(checkpoint)
    try:
        (seen,) = llm.apply_model(support.dash_attention_backends)
        prompt = _prompts()[0][1]
        ((tok, lp),) = _generate(llm, [[prompt]])
    finally:
        _close(llm)
    assert seen == ["FLASHINFER"] * 2
    want_tok, want_lp = reference_generate(checkpoint, prompt, NEW_TOKENS, params=DashParams.from_config(CHECKPOINT))
    assert tok == want_tok
    # as in test_sparse_generation_matches_the_oracle_model
    torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), torch.tensor(want_lp, dtype=torch.float64),
                               atol=2e-4, rtol=0)
