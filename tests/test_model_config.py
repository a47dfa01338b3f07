"""dash_core.model_config: the serving options both engine adapters read from a model's HF config.

The attention-stage choice (config key ``dash_attention_backend``, environment ``DASH_ATTENTION_BACKEND``)
and the auxiliary-head keys (``AuxConfig``, docs/semantics.md section 9). Configs are mappings here and
attribute objects (like a HF ``PretrainedConfig``) where the reading path differs.
"""

import types

import pytest
import torch

from dash_core.model_config import ATTENTION_BACKEND_ENV, AuxConfig, serving_params
from dash_core.params import DashParams
from dash_core.rope import ROLE_PAGE, ROLE_PAGE_START, ROLE_TEXT

CFG = dict(chunk_size=16, dash_topk=4)
PAGE_START, PAGE_TOKEN = 3, 4  # placeholder ids of the test configs
AUX_KEYS = dict(dash_indexer_heads=2, dash_page_mode=True, dash_page_start_token_id=PAGE_START,
                dash_page_token_id=PAGE_TOKEN)


# ---- serving_params: the attention-stage backend --------------------------------------------------

def test_backend_from_the_config_key_and_the_default():
    assert ATTENTION_BACKEND_ENV == "DASH_ATTENTION_BACKEND"
    assert serving_params(CFG, environ={}).attention_backend == "TRITON"
    assert serving_params(dict(CFG, dash_attention_backend="FLASH_ATTN"), environ={}).attention_backend == "FLASH_ATTN"
    obj = types.SimpleNamespace(**CFG, dash_attention_backend="FLASHINFER")  # a HF config: attributes
    assert serving_params(obj, environ={}).attention_backend == "FLASHINFER"


def test_the_rest_of_the_params_come_from_the_config():
    got = serving_params(dict(CFG, scaling_factor=2.0, dash_local=32), environ={ATTENTION_BACKEND_ENV: "FLASHINFER"})
    assert got == DashParams(block_size=16, topk=4, scaling_factor=2.0, local=32, attention_backend="FLASHINFER")


@pytest.mark.parametrize("env,want", [("flashinfer", "FLASHINFER"), ("Flash_Attn", "FLASH_ATTN"),
                                      (" TRITON\n", "TRITON"), (" ", "FLASH_ATTN"), ("", "FLASH_ATTN")])
def test_environment_wins_in_any_case_and_blank_is_unset(env, want):
    cfg = dict(CFG, dash_attention_backend="FLASH_ATTN")
    assert serving_params(cfg, environ={ATTENTION_BACKEND_ENV: env}).attention_backend == want


def test_the_process_environment_is_the_default(monkeypatch):
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "flashinfer")
    assert serving_params(CFG).attention_backend == "FLASHINFER"
    monkeypatch.delenv(ATTENTION_BACKEND_ENV)
    assert serving_params(CFG).attention_backend == "TRITON"


def test_bad_values_name_the_variable_or_key_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"environment variable DASH_ATTENTION_BACKEND = 'cudnn' is not allowed: "
                                         r"expected one of TRITON, FLASH_ATTN, FLASHINFER"):
        serving_params(CFG, environ={ATTENTION_BACKEND_ENV: "cudnn"})
    with pytest.raises(ValueError, match="attention_backend = 'flash' is not allowed"):
        serving_params(dict(CFG, dash_attention_backend="flash"), environ={})
    with pytest.raises(ValueError, match="attention_backend = 'triton' is not allowed"):  # the key is exact
        serving_params(dict(CFG, dash_attention_backend="triton"), environ={})


@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN"])
def test_a_segment_backend_without_topk_fails_at_start_up(backend):
    """The segment backends need a static segment count (``dash_topk``); TRITON does not."""
    with pytest.raises(ValueError, match="topk = None is not allowed for the segment backends"):
        serving_params(dict(chunk_size=16), environ={ATTENTION_BACKEND_ENV: backend})
    with pytest.raises(ValueError, match="topk = None is not allowed for the segment backends"):
        serving_params(dict(chunk_size=16, dash_attention_backend=backend), environ={})
    assert serving_params(dict(chunk_size=16), environ={ATTENTION_BACKEND_ENV: "TRITON"}).topk is None


# ---- AuxConfig: indexer and page mode ----------------------------------------------------------

def test_aux_config_of_plain_indexer_and_page_mode_models():
    plain = AuxConfig.from_config({})
    assert plain == AuxConfig() and not plain.needs_aux and plain.summary_heads is None
    idx = AuxConfig.from_config(types.SimpleNamespace(dash_indexer_heads=2, dash_page_mode=None))
    assert idx == AuxConfig(indexer_heads=2) and idx.needs_aux and idx.summary_heads == 1
    page = AuxConfig.from_config(dict(dash_page_mode=True, dash_page_start_token_id=PAGE_START,
                                      dash_page_token_id=PAGE_TOKEN, vocab_size=512))
    assert page == AuxConfig(None, True, PAGE_START, PAGE_TOKEN) and page.needs_aux and page.summary_heads is None
    both = AuxConfig.from_config(dict(AUX_KEYS, vocab_size=512))
    assert both == AuxConfig(2, True, PAGE_START, PAGE_TOKEN) and both.summary_heads == 1
    # placeholder ids without page mode are ignored (not validated, not kept)
    assert AuxConfig.from_config(dict(dash_page_start_token_id=PAGE_START, dash_page_token_id=PAGE_START)) == plain


@pytest.mark.parametrize("keys,match", [
    (dict(dash_indexer_heads=0), "dash_indexer_heads = 0 is not allowed: expected None or an integer >= 1"),
    (dict(dash_indexer_heads=True), "dash_indexer_heads = True"),
    (dict(dash_indexer_heads="2"), "dash_indexer_heads = '2'"),
    (dict(dash_page_mode=1), "dash_page_mode = 1 is not allowed: expected true or false"),
    (dict(dash_page_mode=True, dash_page_start_token_id=3), "dash_page_token_id = None is not allowed"),
    (dict(dash_page_mode=True, dash_page_token_id=4), "dash_page_start_token_id = None"),
    (dict(AUX_KEYS, dash_page_start_token_id=600, vocab_size=512),
     r"dash_page_start_token_id = 600 is not allowed: expected a token id in 0\.\.511"),
    (dict(AUX_KEYS, dash_page_token_id=-1), r"dash_page_token_id = -1 .* in 0\.\.vocab_size - 1"),
    (dict(AUX_KEYS, dash_page_token_id=False), "dash_page_token_id = False"),
    (dict(AUX_KEYS, dash_page_token_id=PAGE_START), "dash_page_token_id = 3 .* other than dash_page_start_token_id"),
])
def test_aux_config_errors_name_the_key_value_and_what_is_allowed(keys, match):
    with pytest.raises(ValueError, match=match):
        AuxConfig.from_config(keys)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_roles_from_the_placeholder_ids(dtype):
    """Role 1 at the page-start id, 2 at the page-token id, 0 (text) elsewhere; int64 whatever the ids' dtype."""
    ids = torch.tensor([7, PAGE_START, PAGE_TOKEN, PAGE_TOKEN, 9, PAGE_START, PAGE_TOKEN, 0], dtype=dtype)
    roles = AuxConfig.from_config(dict(AUX_KEYS, vocab_size=512)).roles(ids)
    assert roles.dtype == torch.int64
    assert roles.tolist() == [ROLE_TEXT, ROLE_PAGE_START, ROLE_PAGE, ROLE_PAGE, ROLE_TEXT, ROLE_PAGE_START,
                              ROLE_PAGE, ROLE_TEXT] == [0, 1, 2, 2, 0, 1, 2, 0]
    assert AuxConfig(indexer_heads=2).roles(ids).tolist() == [0] * 8  # no page mode: every token is text
    assert AuxConfig.from_config(dict(AUX_KEYS)).roles(ids[:0]).tolist() == []
