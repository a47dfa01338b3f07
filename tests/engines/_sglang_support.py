"""Shared helpers of the SGLang engine tests (tests/engines/test_sglang_*.py).

These tests run real SGLang 0.5.23 on the CPU (``ci/setup_sglang.sh`` builds the environment,
including the test-only rope shim SGLang's generic CPU path needs). Helpers here wire SGLang's own
attention test kit to the ``dash`` backend and start engines on a tiny random DASH Llama.
"""

from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch

from dash_core import DashParams
from tests.engines import _levels

# Every engine here runs with a small KV pool: without --max-total-tokens SGLang's CPU path sizes the pool
# from system memory (about 70 % of it).
MAX_TOTAL_TOKENS = 4096


def budget(name: str, seconds: float):
    """A module-scoped fixture that prints the module's run time against its budget (no assertion)."""
    return _levels.budget("sglang", name, seconds, "(after the shared SGLang import at collection)")


def check_free_disk(path: str, need_gb: float = _levels.MIN_FREE_GB) -> None:
    """Fail with a clear message when ``path``'s filesystem has less than ``need_gb`` free."""
    _levels.check_free_disk("SGLang", path, need_gb)


def dash_config_keys(params: DashParams) -> dict:
    """``params`` as the model-config keys a DASH checkpoint carries (docs/semantics.md section 1)."""
    return dict(chunk_size=params.block_size, scaling_factor=params.scaling_factor, sigma=params.sigma,
                estimate_diagonal=params.estimate_diagonal, dash_topk=params.topk, dash_local=params.local,
                dash_router=params.router)


@contextlib.contextmanager
def fake_tp(tp: int, rank: int, **extra):
    """SGLang's parallel context as rank ``rank`` of a TP ``tp`` job (one node, no DP/CP/EP, no PP).

    Scoped overrides win over whatever configuration the test process published earlier (an engine
    started in-process publishes TP 1), so every width is stated consistently here. Process groups
    are stand-ins carrying only ``rank_in_group`` and ``world_size``, which is all that building and
    loading a model reads.
    """
    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(rank_in_group=rank, world_size=tp, cpu_group=None, device_group=None)
    pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, rank_in_group=0, world_size=1)
    with get_parallel().override(tp_size=tp, tp_rank=rank, attn_tp_size=tp, attn_tp_rank=rank, attn_dp_size=1,
                                 attn_dp_rank=0, attn_cp_size=1, attn_cp_rank=0, moe_ep_size=1, moe_dp_size=1,
                                 moe_tp_size=tp, pp_size=1, pp_rank=0, tp_group=group, attn_tp_group=group,
                                 moe_tp_group=None, pp_group=pp_group, **extra):
        yield


class KitTestCase:
    """The ``testcase`` argument SGLang's attention kit expects (it only calls ``skipTest``). The kit skips where
    building the backend raises an assertion or import error; for the ``dash`` backend that is a failure."""

    def skipTest(self, reason):
        pytest.fail(f"SGLang's attention kit would skip this case: {reason}")


def head_cls_for(num_kv_heads: int, head_dim: int, seed: int = 7) -> torch.Tensor:
    """A deterministic test ``head_cls [Hkv, D]`` (float32, unit-scale entries)."""
    g = torch.Generator().manual_seed(seed * 1000 + num_kv_heads * 10 + head_dim)
    return torch.randn(num_kv_heads, head_dim, generator=g)


@pytest.fixture
def dash_kit(monkeypatch):
    """Returns ``use(params)``: point SGLang's attention kit at the ``dash`` backend with ``params``.

    The kit builds a tiny model config without DASH keys and a ``ProjectedDenseAttention`` whose
    forward passes no ``head_cls``; ``use`` adds the keys to the config the backend reads and makes
    that forward pass ``head_cls_for(Hkv, D)`` (stored on the module as ``dash_head_cls``), as a
    DASH model does.
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit

    from adapters.sglang.backend import DashAttnBackend
    from adapters.sglang.plugin import register

    register()
    torch.set_grad_enabled(False)  # the kit writes KV outside no_grad

    def use(params: DashParams):
        def factory(runner):
            for key, value in dash_config_keys(params).items():
                setattr(runner.model_config.hf_config, key, value)
            return DashAttnBackend(runner)

        def forward(self, hidden_states, forward_batch):
            q, k, v = self.project_qkv(hidden_states)
            if not hasattr(self, "dash_head_cls"):
                self.dash_head_cls = head_cls_for(self.num_kv_heads, self.head_dim).to(hidden_states.dtype)
            return self.o_proj(self.attn(q, k, v, forward_batch, head_cls=self.dash_head_cls))

        monkeypatch.setitem(ATTENTION_BACKENDS, "dash", factory)
        monkeypatch.setattr(kit.ProjectedDenseAttention, "forward", forward)
        return kit

    yield use
    torch.set_grad_enabled(True)


def write_tiny_checkpoint(path: str, **overrides) -> dict:
    """The lead's tiny random DASH Llama (``tests/tiny_dash_llama.py``) at ``path``."""
    from tests.tiny_dash_llama import write_checkpoint

    check_free_disk(os.path.dirname(path) or ".")
    return write_checkpoint(path, **overrides)


@contextlib.contextmanager
def engine(model_path: str, **kw):
    """A real ``sgl.Engine`` on the CPU (float32, no CUDA graphs, small KV pool), shut down on exit."""
    import sglang as sgl

    args = dict(model_path=model_path, device="cpu", dtype="float32", max_total_tokens=MAX_TOTAL_TOKENS,
                attention_backend="dash", page_size=16, random_seed=0, disable_cuda_graph=True,
                skip_tokenizer_init=True, log_level="warning")
    args.update(kw)
    eng = sgl.Engine(**args)
    try:
        yield eng
    finally:
        eng.shutdown()


def generate(eng, prompts: list, max_new_tokens: int = 4, with_prompt_logprobs: bool = True) -> list:
    """Greedy generation with output (and optionally prompt) log-probabilities, one dict per prompt.

    Prompt log-probabilities make SGLang recompute the whole prompt (no prefix-cache hit); leave them
    out where a cache hit is wanted.
    """
    start = {"logprob_start_len": 0} if with_prompt_logprobs else {}
    out = eng.generate(input_ids=[list(p) for p in prompts],
                       sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0},
                       return_logprob=True, **start)
    return out if isinstance(out, list) else [out]


def prompt_logprobs(result: dict) -> list:
    """Log-probability of prompt token t given tokens < t, for t = 1 .. len - 1."""
    return [x[0] for x in result["meta_info"]["input_token_logprobs"][1:]]


def ref_prompt_logprobs(path: str, ids: list, dense: bool = False) -> list:
    """The reference forward's log-probability of prompt token t given tokens < t, for t = 1 .. len - 1."""
    from tests.tiny_dash_llama import reference_logprobs

    lp = reference_logprobs(path, ids, dense=dense)
    return [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]


def max_diff(a: list, b: list) -> float:
    """Largest absolute difference of two equally long lists of numbers."""
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@contextlib.contextmanager
def environment(**values):
    """Set environment variables for an engine start (SGLang's processes inherit them); restore them after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def output_logprobs(result: dict) -> list:
    return [x[0] for x in result["meta_info"]["output_token_logprobs"]]


def prompt(length: int, seed: int, vocab: int = 95) -> list:
    """Deterministic token ids in the tokenizer's printable range (ids 3 .. vocab + 2)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (length,), generator=g) + 3).tolist()
