"""The serving rule both adapters apply before the weights load, and the start-up line they log
(``dash_core.model_config``: ``check_attention_choice``, ``allow_dense``, ``serving_summary``)."""

import types

import pytest
import torch

from dash_core.model_config import (ALLOW_DENSE_ENV, AuxConfig, allow_dense, check_attention_choice, is_dash_model,
                                    serving_summary, uses_kernels)
from dash_core.params import DashParams

DASH = dict(architectures=["DashLlamaForCausalLM"], chunk_size=16)
PLAIN = dict(architectures=["LlamaForCausalLM"])
FLAG = "--attention-backend dash"


def test_which_configs_are_dash_models():
    assert is_dash_model(DASH) and is_dash_model(types.SimpleNamespace(**DASH))  # mapping or HF config object
    assert not is_dash_model(PLAIN) and not is_dash_model({}) and not is_dash_model(dict(architectures=None))


def test_dash_attention_for_a_dash_model_and_dense_for_a_plain_one_start():
    assert check_attention_choice(DASH, True, FLAG, FLAG, environ={}) is False
    assert check_attention_choice(PLAIN, False, "--attention-backend torch_native", FLAG, environ={}) is False


def test_a_dash_model_without_dash_attention_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"DASH checkpoint .*--attention-backend torch_native would serve it with "
                                         r"dense attention.*add --attention-backend dash.*DASH_ALLOW_DENSE=1"):
        check_attention_choice(DASH, False, "--attention-backend torch_native", FLAG, environ={})


@pytest.mark.parametrize("value", ["1", "true", " YES ", "on"])
def test_allow_dense_lets_it_start_and_says_so(value):
    assert allow_dense({ALLOW_DENSE_ENV: value})
    assert check_attention_choice(DASH, False, "x", FLAG, environ={ALLOW_DENSE_ENV: value}) is True


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_allow_dense_off(value):
    assert not allow_dense({ALLOW_DENSE_ENV: value})
    with pytest.raises(ValueError, match="dense attention"):
        check_attention_choice(DASH, False, "x", FLAG, environ={ALLOW_DENSE_ENV: value})


def test_a_bad_allow_dense_value_names_the_variable():
    with pytest.raises(ValueError, match=r"DASH_ALLOW_DENSE = 'maybe' is not allowed: expected 1"):
        allow_dense({ALLOW_DENSE_ENV: "maybe"})


def test_dash_attention_for_a_plain_model_is_refused_even_with_the_override():
    for env in ({}, {ALLOW_DENSE_ENV: "1"}):
        with pytest.raises(ValueError, match=r"selects DASH attention, but the model is not a DASH model \(archi"
                                             r"tectures \['LlamaForCausalLM'\]\).*or drop --attention-backend dash"):
            check_attention_choice(PLAIN, True, FLAG, FLAG, environ=env)


def test_the_kernel_rule():
    assert uses_kernels("cuda:0", torch.bfloat16) and uses_kernels(torch.device("cuda"), torch.float16)
    assert not uses_kernels("cuda", torch.float32) and not uses_kernels("cpu", torch.bfloat16)


def test_the_start_up_line_names_the_path_and_the_settings():
    p = DashParams(block_size=16, topk=2, scaling_factor=4.0)
    cpu = serving_summary(p, "cpu", torch.float32, AuxConfig(), page_size=16)
    assert cpu.startswith("DASH attention on: PyTorch paged path (cpu, float32: for correctness and tests")
    assert "block size 16, page size 16, topk 2, local 16, router kv_head, scaling_factor 4" in cpu
    assert "TRITON" not in cpu and "Triton kernels" not in cpu
    gpu = serving_summary(DashParams(block_size=64, topk=64, attention_backend="FLASHINFER"), "cuda:0", torch.bfloat16)
    assert gpu.startswith("DASH attention on: Triton kernels (cuda, bfloat16), decode attention stage FLASHINFER;")
    assert "topk 64" in gpu
    aux = serving_summary(DashParams(attention_backend="FLASH_ATTN", topk=4), "cpu", torch.bfloat16,
                          AuxConfig(indexer_heads=3, page_mode=True, page_start_token_id=1, page_token_id=2))
    assert "dash_attention_backend FLASH_ATTN applies on CUDA bf16/fp16 only" in aux
    assert aux.endswith("indexer 3 heads, page mode")
