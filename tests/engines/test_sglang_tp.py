"""Tensor parallelism without GPUs: SGLang's own model construction and weight loader, with a faked rank.

For every rank of TP 2 and 4, ``DashLlamaForCausalLM`` is built under SGLang's parallel context
(``tp_rank``/``tp_size`` overridden, no process groups) and loads the tiny checkpoint through
``load_weights``. Each rank's ``head_cls`` rows must be the rows of exactly the KV heads whose
``k_proj`` rows ``QKVParallelLinear`` gave that rank: split across ranks, or replicated where
SGLang replicates KV heads (fewer KV heads than ranks). Then DASH's per-KV-head routing needs no
communication between ranks.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from dash_core import DashParams
from tests.engines._sglang_support import (
    KitTestCase,
    budget,
    dash_kit,
    fake_tp,
    write_tiny_checkpoint,
)

_budget = budget("tp", 90)


def _model_for_rank(path: str, tp: int, rank: int):
    """Build the DASH Llama as rank ``rank`` of ``tp`` would, and load the checkpoint into it."""
    from safetensors.torch import load_file
    from sglang.srt.runtime_context import get_context
    from transformers import LlamaConfig

    from adapters.sglang.models.dash_llama import DashLlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(path)
    with get_context().override_server_args(tp_size=tp, device="cpu", attention_backend="dash"), fake_tp(tp, rank):
        model = DashLlamaForCausalLM(cfg)
        model.load_weights(iter(load_file(f"{path}/model.safetensors").items()))
    return model


@pytest.mark.parametrize("tp,hq,hkv", [(2, 4, 2), (2, 8, 4), (4, 8, 4), (4, 4, 2)],
                         ids=["tp2-split1", "tp2-split2", "tp4-split1", "tp4-replicated"])
def test_head_cls_is_sharded_with_the_kv_heads(tmp_path, tp, hq, hkv):
    from safetensors.torch import load_file

    path = str(tmp_path / "ckpt")
    cfg = write_tiny_checkpoint(path, num_attention_heads=hq, num_key_value_heads=hkv)
    d, layers = cfg["head_dim"], cfg["num_hidden_layers"]
    sd = load_file(f"{path}/model.safetensors")
    seen = set()
    for rank in range(tp):
        model = _model_for_rank(path, tp, rank)
        local = max(1, hkv // tp)
        first = rank * local if hkv >= tp else rank // (tp // hkv)  # SGLang's KV-head placement
        for i in range(layers):
            attn = model.model.layers[i].self_attn
            hc = attn.head_cls.detach()
            assert hc.shape == (local, d)
            want = sd[f"model.layers.{i}.self_attn.indexer_q"].view(hkv, d)[first:first + local]
            assert torch.equal(hc, want)
            # The k_proj rows this rank got belong to the same KV heads as its head_cls rows.
            q_rows = attn.num_heads * d
            k_local = attn.qkv_proj.weight.detach()[q_rows:q_rows + local * d]
            k_ckpt = sd[f"model.layers.{i}.self_attn.k_proj.weight"].view(hkv, d, -1)[first:first + local]
            assert torch.equal(k_local, k_ckpt.reshape(local * d, -1))
        seen.update(range(first, first + local))
    assert seen == set(range(hkv))  # every KV head's head_cls lives on some rank


def test_checkpoint_without_the_dash_weight_fails_clearly(tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "ckpt")
    write_tiny_checkpoint(path)
    sd = load_file(f"{path}/model.safetensors")
    del sd["model.layers.1.self_attn.indexer_q"]
    save_file(sd, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 DASH weight.*model\.layers\.1\.self_attn\.indexer_q"):
        _model_for_rank(path, 1, 0)


def test_dash_weight_with_wrong_shape_fails_clearly(tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "ckpt")
    write_tiny_checkpoint(path)
    sd = load_file(f"{path}/model.safetensors")
    sd["model.layers.0.self_attn.indexer_q"] = sd["model.layers.0.self_attn.indexer_q"][:-1].clone()
    save_file(sd, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"indexer_q of layer 0 has shape \(63,\); expected \[2 \* 32\]"):
        _model_for_rank(path, 1, 0)


def test_router_shared_is_refused_under_tensor_parallelism(dash_kit):
    """Router ``shared`` averages over all query heads: with heads split across ranks it would need an
    all-reduce of routing probabilities in every layer, which the adapter does not do."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    kit = dash_kit(DashParams(block_size=16, router="shared"))
    case = kit.DenseAttentionCase(name="dash_shared_tp", backend="dash", forward_mode=ForwardMode.DECODE,
                                  num_heads=4, num_kv_heads=2, page_size=16, prefix_lens=(4,))
    with fake_tp(2, 0):
        with pytest.raises(ValueError, match="router 'shared' with attention tensor parallelism 2"):
            kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=48, dtype=torch.float32,
                                              device="cpu")
    # At TP 1 the same configuration is accepted.
    kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=48, dtype=torch.float32, device="cpu")


def test_indexer_weights_are_replicated_on_every_rank(tmp_path):
    """The indexer's one shared selection averages all Hi heads: every rank holds the whole indexer."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "ckpt")
    cfg = write_tiny_checkpoint(path, indexer_heads=3, page_mode=True)
    sd = load_file(f"{path}/model.safetensors")
    for rank in range(2):
        model = _model_for_rank(path, 2, rank)
        assert model.dash_page_rope is not None and model.dash_page_rope.main.theta == cfg["rope_theta"]
        for i in range(cfg["num_hidden_layers"]):
            ind = model.model.layers[i].self_attn.dash_indexer
            pre = f"model.layers.{i}.self_attn.dash_indexer."
            assert torch.equal(ind.wq.weight.detach(), sd[pre + "wq.weight"])  # [3 * D, hidden], all heads
            assert torch.equal(ind.wk.weight.detach(), sd[pre + "wk.weight"])
            assert torch.equal(ind.head_cls.detach(), sd[pre + "head_cls"])
    del sd["model.layers.1.self_attn.dash_indexer.wk.weight"]
    save_file(sd, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 DASH weight.*model\.layers\.1\.self_attn\.dash_indexer\.wk\.weight"):
        _model_for_rank(path, 1, 0)
