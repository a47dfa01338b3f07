"""The tiny DASH Llama's reference model with an indexer and/or page mode (docs/semantics.md section 9)."""

import pytest
import torch

from dash_core.rope import page_rope
from tests.test_indexer_reference import direct_indexer_dash
from tests.test_rope import direct_coordinates
from tests.tiny_dash_llama import (PAGE_START_TOKEN_ID, PAGE_TOKEN_ID, _rms, _rope, load, page_rope_settings,
                                   reference_generate, reference_logprobs, write_checkpoint)

PROMPT = [1] + [int(x) for x in torch.randint(3, 400, (70,), generator=torch.Generator().manual_seed(3))]


def test_page_mode_without_pages_is_the_plain_model(tmp_path):
    """No placeholder in the prompt: page RoPE at tok = page = position is ordinary RoPE, so the
    page-mode model equals the plain one of the same seed (both float64; 1e-9 covers the two RoPE
    formulas' rounding, while a wrong coordinate moves log-probabilities by >> 1e-3)."""
    write_checkpoint(str(tmp_path / "plain"), seed=5, scaling_factor=4.0)
    write_checkpoint(str(tmp_path / "page"), seed=5, scaling_factor=4.0, page_mode=True)
    a = reference_logprobs(str(tmp_path / "plain"), PROMPT)
    b = reference_logprobs(str(tmp_path / "page"), PROMPT)
    assert torch.allclose(a, b, atol=1e-9, rtol=0)
    ga = reference_generate(str(tmp_path / "plain"), PROMPT[:40], 3)
    gb = reference_generate(str(tmp_path / "page"), PROMPT[:40], 3)
    assert ga[0] == gb[0] and max(abs(x - y) for x, y in zip(ga[1], gb[1])) < 1e-9
    # with pages the two models differ (the placeholders change the coordinates)
    paged = PROMPT[:10] + [PAGE_START_TOKEN_ID] + [PAGE_TOKEN_ID] * 20 + PROMPT[10:30]
    c = reference_logprobs(str(tmp_path / "plain"), paged)
    d = reference_logprobs(str(tmp_path / "page"), paged)
    assert (c[11:] - d[11:]).abs().max() > 1e-3


def _direct_one_layer(path, ids, prompt_len):
    """A one-layer checkpoint's log-probabilities written out by hand: indexer routing by
    ``direct_indexer_dash``, page coordinates by the literal SPEC derivation ``direct_coordinates``."""
    cfg, sd = load(path)
    t = len(ids)
    hq, hkv, hd, hi = (cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                        "dash_indexer_heads"))
    eps = cfg["rms_norm_eps"]
    if cfg.get("dash_page_mode"):
        roles = [1 if i == cfg["dash_page_start_token_id"] else 2 if i == cfg["dash_page_token_id"] else 0
                 for i in ids[:prompt_len]]
        tok, page = (torch.tensor(c) for c in direct_coordinates(roles, t - prompt_len))

        def rope(x):
            return page_rope(x, tok, page, page_rope_settings(cfg))
    else:
        def rope(x):
            return _rope(x, torch.arange(t), cfg["rope_theta"])
    pre = "model.layers.0."
    h = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    x = _rms(h, sd[pre + "input_layernorm.weight"], eps)
    q = rope((x @ sd[pre + "self_attn.q_proj.weight"].T).view(t, hq, hd)).permute(1, 0, 2)
    k = rope((x @ sd[pre + "self_attn.k_proj.weight"].T).view(t, hkv, hd)).permute(1, 0, 2)
    v = (x @ sd[pre + "self_attn.v_proj.weight"].T).view(t, hkv, hd).permute(1, 0, 2)
    iq = rope((x @ sd[pre + "self_attn.dash_indexer.wq.weight"].T).view(t, hi, hd)).permute(1, 0, 2)
    ik = rope((x @ sd[pre + "self_attn.dash_indexer.wk.weight"].T).view(t, 1, hd))[:, 0]
    from dash_core import DashParams
    a = direct_indexer_dash(q, k, v, iq, ik, sd[pre + "self_attn.dash_indexer.head_cls"],
                            DashParams.from_config(cfg))
    h = h + a.permute(1, 0, 2).reshape(t, hq * hd) @ sd[pre + "self_attn.o_proj.weight"].T
    x = _rms(h, sd[pre + "post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(x @ sd[pre + "mlp.gate_proj.weight"].T) * (x @ sd[pre + "mlp.up_proj.weight"].T)
    h = h + mlp @ sd[pre + "mlp.down_proj.weight"].T
    return torch.log_softmax(_rms(h, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T, -1)


@pytest.mark.parametrize("page_mode", [False, True])
def test_indexer_model_reference_equals_direct_one_layer(tmp_path, page_mode):
    """The reference of a one-layer indexer model (optionally in page mode, with two pages, text
    between them and two generated tokens) equals the hand-written forward. Both are float64 and
    compute the same sums in a different order: 1e-9."""
    path = str(tmp_path / "m")
    write_checkpoint(path, seed=7, num_hidden_layers=1, scaling_factor=4.0, indexer_heads=3, page_mode=page_mode)
    ids = (PROMPT[:9] + [PAGE_START_TOKEN_ID] + [PAGE_TOKEN_ID] * 23 + PROMPT[9:14]
           + [PAGE_START_TOKEN_ID] + [PAGE_TOKEN_ID] * 17 + PROMPT[14:30])
    prompt_len = len(ids) - 2
    ref = reference_logprobs(path, ids, prompt_len=prompt_len)
    direct = _direct_one_layer(path, ids, prompt_len)
    assert torch.allclose(ref, direct, atol=1e-9, rtol=0)
    # the indexer routes: the same checkpoint without it gives other log-probabilities
    plain = str(tmp_path / "plain")
    write_checkpoint(plain, seed=7, num_hidden_layers=1, scaling_factor=4.0, page_mode=page_mode)
    assert (reference_logprobs(plain, ids, prompt_len=prompt_len) - ref).abs().max() > 1e-3
