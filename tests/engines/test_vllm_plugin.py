"""Registration through the entry point, the KV cache spec (summary bytes per page), kernel block
sizes, and the summary store's place in vLLM's own cache allocation."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("vllm")

import torch

from dash_core import DashParams

from tests.engines._vllm_support import allocate_kv_cache, budget, dash_layer, engine_config
from tests.tiny_dash_llama import write_checkpoint

pytestmark = pytest.mark.engine_vllm
_budget = budget("plugin-and-spec", 60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints with DASH block sizes 16 and 64."""
    out = {}
    for bs in (16, 64):
        path = str(tmp_path_factory.mktemp(f"tiny{bs}"))
        write_checkpoint(path, chunk_size=bs)
        out[bs] = path
    return out


def test_entry_point_is_installed():
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "dash"]
    assert [e.value for e in eps] == ["adapters.vllm.plugin:register"]


def test_vllm_loads_the_plugin_and_custom_resolves_to_dash(checkpoints):
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from adapters.vllm.backend import DashAttentionBackend
    from adapters.vllm.models import DashLlamaForCausalLM
    from adapters.vllm.plugin import register

    load_general_plugins()  # what every vLLM process does
    register()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_class() is DashAttentionBackend
    assert AttentionBackendEnum["custom".upper()].get_path() == "adapters.vllm.backend.DashAttentionBackend"
    assert DashAttentionBackend.get_name() == "CUSTOM"
    model_config = engine_config(checkpoints[16]).model_config
    model_cls, arch = ModelRegistry.resolve_model_cls(["DashLlamaForCausalLM"], model_config=model_config)
    assert model_cls is DashLlamaForCausalLM and arch == "DashLlamaForCausalLM"


@pytest.mark.parametrize("bs,dtype", [(16, "float32"), (64, "float32"), (64, "bfloat16")])
def test_spec_adds_one_summary_per_page(checkpoints, bs, dtype):
    """Each page of ``bs`` tokens gains ``Hkv * D`` elements: ``1 / (2 bs)`` of its K/V bytes."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import MultipleOf

    from adapters.vllm.backend import DashAttentionBackend

    cfg = engine_config(checkpoints[bs], block_size=bs, dtype=dtype)
    params = DashParams.from_config(cfg.model_config.hf_config)
    assert params.block_size == bs
    layer, spec, _ = dash_layer(cfg, params, torch.zeros(2, 32))
    esz = torch.empty((), dtype=spec.dtype).element_size()
    kv_bytes = bs * 2 * (2 * 32) * esz  # tokens x Hkv x (K + V) x bytes
    assert spec.unpadded_page_size_bytes == kv_bytes
    assert spec.page_size_bytes - kv_bytes == 2 * 32 * esz
    assert (spec.page_size_bytes - kv_bytes) / kv_bytes == 1 / (2 * bs)
    assert DashAttentionBackend.customize_spec(spec) == spec  # applying it again changes nothing

    with set_current_vllm_config(cfg):
        assert DashAttentionBackend.get_supported_kernel_block_sizes() == [bs]
        assert DashAttentionBackend.get_preferred_block_size(16) == bs
    assert DashAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_summary_store_lives_in_the_page_padding(checkpoints, layout):
    """Writing every summary leaves every K/V element intact, and the store covers exactly the
    padding bytes of vLLM's allocation."""
    from adapters.vllm.backend import summary_view

    cfg = engine_config(checkpoints[16], block_size=16)
    _, spec, _ = dash_layer(cfg, DashParams(block_size=16), torch.zeros(2, 32))
    raw, kv = allocate_kv_cache(spec, 10, layout)
    kv.copy_(torch.arange(kv.numel(), dtype=kv.dtype).reshape(kv.shape))
    before = kv.clone()
    store = summary_view(kv, 2, 32)
    assert store.shape == (10, 2, 32) and store.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    store.fill_(-1.0)
    assert torch.equal(kv, before)
    as_f32 = raw.view(torch.float32)
    assert int((as_f32 == -1.0).sum()) == store.numel() == 10 * 2 * 32
    assert as_f32.numel() == kv.numel() + store.numel()


def test_block_size_other_than_dash_block_is_refused(checkpoints):
    # by the plugin's config hook, when vLLM builds the configuration
    with pytest.raises(ValueError, match=r"page size must be a multiple of the DASH block size.*--block-size 16"):
        engine_config(checkpoints[16], block_size=32)
    # and by the layer's builder, for a configuration changed after the hook ran
    cfg = engine_config(checkpoints[16], block_size=16)
    cfg.cache_config.block_size = 32
    with pytest.raises(ValueError, match=r"page size must be a multiple of the DASH block size.*--block-size 16"):
        dash_layer(cfg, DashParams(block_size=16), torch.zeros(2, 32))


@pytest.mark.parametrize("dtype,support", [("float32", "NEVER"), ("bfloat16", "UNIFORM_SINGLE_TOKEN_DECODE"),
                                           ("float16", "UNIFORM_SINGLE_TOKEN_DECODE")])
def test_cuda_graph_support_follows_the_decode_path(checkpoints, dtype, support):
    """FULL decode graphs are declared where decode runs the Triton kernels (bf16/fp16); the fp32
    PyTorch path reads lengths on the host, so it declares none."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from adapters.vllm.backend import DashAttentionMetadataBuilder

    cfg = engine_config(checkpoints[16], dtype=dtype)
    assert DashAttentionMetadataBuilder.get_cudagraph_support(cfg, None) == AttentionCGSupport[support]


def test_attention_backend_option_from_the_config_and_the_environment(checkpoints, monkeypatch):
    """``--hf-overrides '{"dash_attention_backend": ...}'`` and ``DASH_ATTENTION_BACKEND`` (which wins)
    both reach the served model's DashParams through vLLM's config; bad values fail at start-up naming what
    is allowed (the option itself: tests/test_model_config.py)."""
    from dash_core.model_config import ATTENTION_BACKEND_ENV, serving_params

    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    topk = {"dash_topk": 4}
    hf = engine_config(checkpoints[16], hf_overrides=dict(topk, dash_attention_backend="FLASHINFER")).model_config
    assert serving_params(hf.hf_config).attention_backend == "FLASHINFER"
    assert serving_params(engine_config(checkpoints[16]).model_config.hf_config).attention_backend == "TRITON"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "flash_attn")
    assert serving_params(hf.hf_config).attention_backend == "FLASH_ATTN"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "CUDNN")
    with pytest.raises(ValueError, match=r"DASH_ATTENTION_BACKEND = 'CUDNN' is not allowed.*FLASHINFER"):
        serving_params(hf.hf_config)
    # the segment backends need a static segment count: no dash_topk, no start
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "FLASHINFER")
    with pytest.raises(ValueError, match="topk = None is not allowed for the segment backends"):
        serving_params(engine_config(checkpoints[16]).model_config.hf_config)


def test_auxiliary_head_is_one_more_kv_head_in_vllms_spec(checkpoints):
    """An indexer layer: ``Hkv + 1`` KV head slots (the auxiliary head, ``1 / Hkv`` of the K/V bytes)
    counted in vLLM's page size, plus the summary padding; the query carries the ``Hi`` indexer heads
    padded to a multiple of ``Hkv + 1``; such models declare no CUDA graphs (their capture has not run in a GPU vLLM
    process)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.utils import customize_attention_spec

    from adapters.vllm.backend import AuxHead, DashAttentionMetadataBuilder, DashAuxAttentionBackend

    cfg = engine_config(checkpoints[16], dtype="bfloat16", hf_overrides={"dash_indexer_heads": 2})
    aux = AuxHead(num_q_heads=4, indexer_heads=2)
    assert aux.q_slots(2) == 6  # 4 + 2 query heads over 3 KV heads
    name = "model.layers.0.self_attn.attn"
    with set_current_vllm_config(cfg):
        cfg.compilation_config.static_forward_context.pop(name, None)
        layer = Attention(aux.q_slots(2), 32, 32 ** -0.5, num_kv_heads=3, prefix=name, cache_config=cfg.cache_config,
                          attn_backend=DashAuxAttentionBackend, head_cls=torch.zeros(2, 32),
                          dash_params=DashParams(block_size=16), dash_aux=aux, head_cls_i=torch.zeros(32))
        spec = customize_attention_spec(DashAuxAttentionBackend, layer.get_kv_cache_spec(cfg))
    assert layer.impl.num_kv_heads == 2 and layer.impl.num_q_heads == 4
    esz = torch.empty((), dtype=spec.dtype).element_size()
    kv_bytes = 16 * 2 * (2 * 32) * esz
    assert spec.num_kv_heads == 3 and spec.unpadded_page_size_bytes == kv_bytes * 3 // 2  # + 1 / Hkv
    assert spec.page_size_bytes - spec.unpadded_page_size_bytes == 2 * 32 * esz  # Hkv * D summary elements
    assert DashAttentionMetadataBuilder.get_cudagraph_support(cfg, spec) == AttentionCGSupport.NEVER
