"""Tensor parallelism without GPUs: vLLM's own model loader builds and loads the DASH Llama as
rank ``r`` of a TP group whose size and rank are faked (nothing else is). Each rank's
``head_cls`` rows must be the KV heads whose ``k_proj`` rows the same rank holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch

from tests.engines._vllm_support import budget, engine_config
from tests.tiny_dash_llama import load, write_checkpoint

pytestmark = pytest.mark.engine_vllm
_budget = budget("tp-sharding", 90)

D = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for hkv in (2, 4):
        path = str(tmp_path_factory.mktemp(f"kv{hkv}"))
        write_checkpoint(path, num_key_value_heads=hkv, num_hidden_layers=1)
        out[hkv] = path
    return out


def _fake_group(size: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=size, rank_in_group=rank, rank=rank, local_rank=0, ranks=list(range(size)),
                           is_first_rank=True, is_last_rank=True, device_group=None, cpu_group=None)


def _load_as_rank(monkeypatch, path: str, tp: int, rank: int, **config):
    """vLLM's loader (its model construction, then its weight loading with the strict check) with the
    TP group faked as (tp, rank). ``load_model`` itself is not called: it empties an accelerator cache."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    monkeypatch.setattr(parallel_state, "_TP", _fake_group(tp, rank))
    monkeypatch.setattr(parallel_state, "_PP", _fake_group(1, 0))
    cfg = engine_config(path, **config)
    loader = get_model_loader(cfg.load_config)
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
        model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
        loader.load_weights(model, cfg.model_config)
    return model


@pytest.mark.parametrize("hkv,tp", [(2, 2), (2, 4), (4, 2), (4, 4)])
def test_head_cls_follows_the_kv_heads_of_each_rank(monkeypatch, checkpoints, hkv, tp):
    from adapters.vllm.backend import DashAttentionImpl
    from adapters.vllm.models import kv_head_range

    _, sd = load(checkpoints[hkv])
    head_cls = sd["model.layers.0.self_attn.indexer_q"].view(hkv, D).float()
    k_proj = sd["model.layers.0.self_attn.k_proj.weight"].view(hkv, D, -1).float()
    per_rank = max(1, hkv // tp)
    seen = []
    for rank in range(tp):
        model = _load_as_rank(monkeypatch, checkpoints[hkv], tp, rank)
        attn = model.model.layers[0].self_attn
        start, end = kv_head_range(hkv, tp, rank)
        assert end - start == per_rank == attn.attn.num_kv_heads
        assert isinstance(attn.attn.impl, DashAttentionImpl)
        # The impl reads the loaded parameter itself, and it holds this rank's rows.
        assert attn.attn.impl.head_cls is attn.indexer_q
        torch.testing.assert_close(attn.indexer_q.data, head_cls[start:end], atol=0, rtol=0)
        # The same KV heads as the K projection of this rank (vLLM's own sharding of qkv_proj).
        qkv = attn.qkv_proj.weight.data
        k_rows = qkv[attn.q_size: attn.q_size + attn.kv_size].view(per_rank, D, -1)
        torch.testing.assert_close(k_rows, k_proj[start:end], atol=0, rtol=0)
        seen.append((start, end))
    # Partitioned when Hkv >= tp (each head on one rank), replicated tp / Hkv times otherwise.
    heads = [h for s, e in seen for h in range(s, e)]
    assert sorted(set(heads)) == list(range(hkv))
    assert all(heads.count(h) == max(1, tp // hkv) for h in range(hkv))


def test_shared_router_is_refused_under_tp(monkeypatch, checkpoints):
    with pytest.raises(ValueError, match="router 'shared' is not supported with tensor parallelism"):
        _load_as_rank(monkeypatch, checkpoints[2], 2, 0, hf_overrides={"dash_router": "shared"})


def test_checkpoint_without_dash_weight_is_refused(monkeypatch, tmp_path):
    """The loader names the missing published weight (vLLM's strict check would only list names)."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    write_checkpoint(path, num_hidden_layers=1)
    sd = load_file(f"{path}/model.safetensors")
    del sd["model.layers.0.self_attn.indexer_q"]
    save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no DASH weight .*self_attn\.indexer_q"):
        _load_as_rank(monkeypatch, path, 1, 0)


@pytest.mark.parametrize("tp", [1, 2])
def test_indexer_weights_load_replicated_on_every_rank(monkeypatch, tmp_path, tp):
    """An indexer checkpoint: every rank holds the whole indexer (wq, wk, head_cls) as stored, and its
    DASH layer has this rank's KV heads plus the auxiliary one."""
    from adapters.vllm.backend import DashAuxAttentionBackend

    path = str(tmp_path)
    write_checkpoint(path, num_key_value_heads=4, num_hidden_layers=1, indexer_heads=3)
    _, sd = load(path)
    pre = "model.layers.0.self_attn.dash_indexer."
    for rank in range(tp):
        model = _load_as_rank(monkeypatch, path, tp, rank)
        attn = model.model.layers[0].self_attn
        ind = attn.dash_indexer
        for got, name in ((ind.wq.weight, "wq.weight"), (ind.wk.weight, "wk.weight"), (ind.head_cls, "head_cls")):
            torch.testing.assert_close(got.data.float(), sd[pre + name].float(), atol=0, rtol=0)
        assert attn.attn.attn_backend is DashAuxAttentionBackend and attn.attn.impl.head_cls_i is ind.head_cls
        assert attn.attn.num_kv_heads == 4 // tp + 1 and attn.attn.impl.num_kv_heads == 4 // tp


def test_checkpoint_without_the_indexer_weights_is_refused(monkeypatch, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    write_checkpoint(path, num_hidden_layers=1, indexer_heads=2)
    sd = load_file(f"{path}/model.safetensors")
    del sd["model.layers.0.self_attn.dash_indexer.wk.weight"]
    save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no indexer weight .*dash_indexer\.wk\.weight"):
        _load_as_rank(monkeypatch, path, 1, 0)
