"""Shared helpers of the vLLM engine tests (tests/engines/test_vllm_*.py).

Everything here uses real vLLM objects (EngineArgs configs, ``Attention`` layers, the KV cache
spec and vLLM's own cache-view allocation); nothing is faked except, in the TP tests, the rank.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from dash_core import DashParams
from tests.engines import _levels


def budget(name: str, seconds: float):
    """A module-scoped fixture that prints the module's run time against its budget (no assertion)."""
    return _levels.budget("vllm", name, seconds)


def check_free_disk(path: str, need_gb: float = _levels.MIN_FREE_GB) -> None:
    """Fail with a clear message when ``path``'s filesystem has less than ``need_gb`` free."""
    _levels.check_free_disk("vLLM", path, need_gb)


def engine_config(model_dir: str, block_size: int = 16, **kw):
    """A real ``VllmConfig`` for the tiny checkpoint (no engine, no workers)."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=block_size,
                max_model_len=512, enforce_eager=True, max_num_seqs=8)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def dash_layer(vllm_config, params: DashParams, head_cls: torch.Tensor, num_heads: int = 4, num_kv_heads: int = 2,
               head_dim: int = 32, name: str = "model.layers.0.self_attn.attn"):
    """A real vLLM ``Attention`` layer bound to the DASH backend, its customised spec and its builder."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.worker.utils import customize_attention_spec

    from adapters.vllm.backend import DashAttentionBackend

    with set_current_vllm_config(vllm_config):
        vllm_config.compilation_config.static_forward_context.pop(name, None)
        layer = Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads=num_kv_heads, prefix=name,
                          cache_config=vllm_config.cache_config, attn_backend=DashAttentionBackend,
                          head_cls=head_cls, dash_params=params)
        spec = customize_attention_spec(DashAttentionBackend, layer.get_kv_cache_spec(vllm_config))
        builder = DashAttentionBackend.get_builder_cls()(spec, [name], vllm_config, torch.device("cpu"))
    return layer, spec, builder


def allocate_kv_cache(spec, num_blocks: int, layout_name: str = "LBHNC") -> tuple[torch.Tensor, torch.Tensor]:
    """(raw int8 buffer, the layer's ``[num_blocks, H, block_size, C]`` view) exactly as vLLM lays them out."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    page = spec.page_size_bytes
    raw = torch.zeros(num_blocks * page, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["layer"], layer_stride=num_blocks * page, block_stride=page)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout[layout_name], tensor)
    return raw, view


def common_metadata(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor,
                    slot_mapping: torch.Tensor):
    """vLLM's ``CommonAttentionMetadata`` for one step (CPU tensors)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl, num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping, seq_lens_cpu_upper_bound=sl.clone())


def slots(block_row: torch.Tensor, positions: range, block_size: int) -> torch.Tensor:
    """Slots of ``positions`` for a request whose pages are ``block_row``."""
    pos = torch.tensor(list(positions), dtype=torch.long)
    return block_row[pos // block_size].long() * block_size + pos % block_size


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --- functions run inside the engine's worker through LLM.apply_model (module level: picklable) ---


def dash_stats(model) -> dict:
    """Summed counters of the DASH impls of this worker's layers (zeros when none is DASH)."""
    from vllm.model_executor.layers.attention import Attention

    total = {"forwards": 0, "decode_tokens": 0, "prefill_tokens": 0}
    for module in model.modules():
        if isinstance(module, Attention) and hasattr(module.impl, "stats"):
            for key, value in module.impl.stats.items():
                total[key] += value
    return total


def dash_attention_backends(model) -> list:
    """``params.attention_backend`` of every DASH layer of this worker, in layer order."""
    from vllm.model_executor.layers.attention import Attention

    return [m.impl.params.attention_backend for m in model.modules()
            if isinstance(m, Attention) and hasattr(m.impl, "stats")]


def dash_kv_cache_shapes(model) -> list:
    """The shape of every DASH layer's bound KV cache view (``[num_blocks, H_slots, block_size, C]``)."""
    from vllm.model_executor.layers.attention import Attention

    shapes = []
    for m in model.modules():
        if isinstance(m, Attention) and hasattr(m.impl, "stats"):
            kv = m.kv_cache[0] if isinstance(m.kv_cache, (list, tuple)) else m.kv_cache
            shapes.append(tuple(kv.shape))
    return shapes


def capture_attention(model) -> None:
    """Record (layer name, q, k, v, output) of every attention call, as CPU float copies."""
    from vllm.model_executor.layers.attention import Attention

    calls, handles = [], []

    def hook(module, args, output):
        q, k, v = args[:3]
        calls.append((module.layer_name, q.detach().float().cpu().clone(), k.detach().float().cpu().clone(),
                      v.detach().float().cpu().clone(), output.detach().float().cpu().clone()))

    for module in model.modules():
        if isinstance(module, Attention):
            handles.append(module.register_forward_hook(hook))
    model._dash_capture = (calls, handles)


def release_attention(model) -> list:
    """Remove the hooks of ``capture_attention`` and return what they recorded."""
    calls, handles = model._dash_capture
    for h in handles:
        h.remove()
    del model._dash_capture
    return calls


# --- a whole engine in a fresh process (multi-process engine, tensor parallelism) ---


def generate_in_subprocess(engine_args: dict, prompts: list, max_tokens: int, out_json: str, env: dict,
                           timeout: float) -> dict:
    """Run ``LLM(**engine_args)`` greedily over ``prompts`` in a new Python process; returns
    ``{"results": [[token ids, logprobs], ...], "stats": [per-worker dash_stats],
    "attention_backends": [per-worker dash_attention_backends]}``."""
    import json
    import subprocess

    args = json.dumps({"engine": engine_args, "prompts": prompts, "max_tokens": max_tokens, "out": out_json})
    log = out_json + ".log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "tests.engines._vllm_support", args], env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        pytest.fail(f"engine process exited with {proc.returncode}; log tail:\n{tail}")
    with open(out_json) as f:
        return json.load(f)


def _main(argv: list) -> None:
    import json

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.engines._vllm_support import dash_attention_backends  # by reference, not as __main__.*
    from tests.engines._vllm_support import dash_stats as stats

    spec = json.loads(argv[0])
    llm = LLM(**spec["engine"])
    sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], logprobs=1, ignore_eos=True, detokenize=False)
    results = []
    for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sp, use_tqdm=False):
        c = out.outputs[0]
        results.append([list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]])
    per_worker = llm.apply_model(stats)
    backends = llm.apply_model(dash_attention_backends)
    with open(spec["out"], "w") as f:
        json.dump({"results": results, "stats": per_worker, "attention_backends": backends}, f)


if __name__ == "__main__":
    _main(sys.argv[1:])
