"""The float64 reference forward of the tiny DASH Llama that ``dash_core.tiny_checkpoint`` writes.

The engine tests compare the engines' log-probabilities and greedy tokens with ``reference_logprobs`` /
``reference_generate``: a plain PyTorch Llama whose attention is the oracle ``dash_reference`` (or dense
causal attention), with the indexer and page RoPE of docs/semantics.md section 9 where the checkpoint
has them. The writer and its defaults are re-exported from ``dash_core.tiny_checkpoint`` (the tool
``python -m dash_core.tiny_checkpoint OUT ...``).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from dash_core import DashParams, dash_reference
from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope
from dash_core.tiny_checkpoint import DEFAULTS, PAGE_START_TOKEN_ID, PAGE_TOKEN_ID, write_checkpoint

__all__ = ["DEFAULTS", "PAGE_START_TOKEN_ID", "PAGE_TOKEN_ID", "load", "page_rope_settings", "prompt_roles",
           "reference_generate", "reference_logprobs", "write_checkpoint"]


def load(path: str) -> tuple[dict, dict]:
    """(config, float64 state dict) of a checkpoint written by ``write_checkpoint``."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    sd = {k: v.to(torch.float64) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    return cfg, sd


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Neox-style rotary embedding of ``x [T, H, D]`` at ``pos [T]`` (HF Llama's convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def prompt_roles(cfg: dict, token_ids) -> torch.Tensor:
    """Roles ``[N]`` int64 of prompt tokens: 1 at the page-start id, 2 at the page-token id, else 0."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    return torch.where(ids == cfg["dash_page_start_token_id"], 1,
                       torch.where(ids == cfg["dash_page_token_id"], 2, 0)).to(torch.long)


def page_rope_settings(cfg: dict) -> PageRopeSettings:
    """The page RoPE settings of a page-mode checkpoint (the indexer shares the heads' rotary settings)."""
    rot = RotarySettings(theta=cfg["rope_theta"])
    return PageRopeSettings(main=rot, indexer=rot, tok_pairs=cfg.get("dash_page_rope_tok_pairs"))


def reference_logprobs(path: str, token_ids, dense: bool = False,
                       params: Optional[DashParams] = None, prompt_len: Optional[int] = None) -> torch.Tensor:
    """Log-softmax ``[T, vocab]`` float64 of the checkpoint on ``token_ids`` (one causal prompt).

    Attention is ``dash_reference`` with the checkpoint's DASH config (or ``params``), or plain
    causal softmax attention with ``dense=True`` (which ignores the indexer, not page RoPE).
    prompt_len: page mode only, the number of prompt tokens (default all); the tokens after it are
    generated ones (role 0, in the query page).
    """
    cfg, sd = load(path)
    p = params or DashParams.from_config(cfg)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    t = ids.numel()
    hq, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hi = cfg.get("dash_indexer_heads")
    pos = torch.arange(t)
    if cfg.get("dash_page_mode"):
        n = t if prompt_len is None else prompt_len
        tok, page = page_coordinates(prompt_roles(cfg, ids[:n]), generated=t - n)
        pr = page_rope_settings(cfg)

        def rope(x, main=True):
            return page_rope(x, tok, page, pr, main=main)
    else:
        def rope(x, main=True):
            return _rope(x, pos, theta)
    h = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        x = _rms(h, sd[pre + "input_layernorm.weight"], eps)
        q = rope((x @ sd[pre + "self_attn.q_proj.weight"].T).view(t, hq, hd))
        k = rope((x @ sd[pre + "self_attn.k_proj.weight"].T).view(t, hkv, hd))
        v = (x @ sd[pre + "self_attn.v_proj.weight"].T).view(t, hkv, hd)
        q4, k4, v4 = (y.permute(1, 0, 2)[None] for y in (q, k, v))
        ind = {}
        if hi is not None:
            xi = pre + "self_attn.dash_indexer."
            iq = rope((x @ sd[xi + "wq.weight"].T).view(t, hi, hd), main=False)
            ik = rope((x @ sd[xi + "wk.weight"].T).view(t, 1, hd), main=False)[:, 0]
            ind = dict(iq=iq.permute(1, 0, 2)[None], ik=ik[None], head_cls_i=sd[xi + "head_cls"])
        if dense:
            rep = hq // hkv
            a = torch.nn.functional.scaled_dot_product_attention(
                q4, k4.repeat_interleave(rep, 1), v4.repeat_interleave(rep, 1), is_causal=True)
        else:
            a, _ = dash_reference(q4, k4, v4, sd[pre + "self_attn.indexer_q"].view(hkv, hd), p, **ind)
        h = h + a[0].permute(1, 0, 2).reshape(t, hq * hd) @ sd[pre + "self_attn.o_proj.weight"].T
        x = _rms(h, sd[pre + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(x @ sd[pre + "mlp.gate_proj.weight"].T) * (x @ sd[pre + "mlp.up_proj.weight"].T)
        h = h + mlp @ sd[pre + "mlp.down_proj.weight"].T
    logits = _rms(h, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T
    return torch.log_softmax(logits, dim=-1)


def greedy_shortfall(path: str, prompt_ids, new_ids) -> float:
    """How far ``new_ids``, generated after ``prompt_ids``, fall short of being the checkpoint's greedy tokens: the
    largest gap, over the new tokens, between the best log-probability and the chosen token's, each given the tokens
    before it (one forward over the prompt and the new tokens; 0 when every token is the argmax)."""
    ids = list(prompt_ids) + list(new_ids)
    lp = reference_logprobs(path, ids[:-1], prompt_len=len(prompt_ids))[len(prompt_ids) - 1:]
    chosen = lp.gather(1, torch.as_tensor(list(new_ids), dtype=torch.long)[:, None])[:, 0]
    return float((lp.max(1).values - chosen).max())


def reference_generate(path: str, prompt_ids, max_new_tokens: int, dense: bool = False,
                       params: Optional[DashParams] = None) -> tuple[list, list]:
    """Greedy generation: (new token ids, log-probability of each chosen token).

    In page mode the generated tokens are text of the query page (role 0), whatever their ids.
    """
    ids = list(prompt_ids)
    new, lps = [], []
    for _ in range(max_new_tokens):
        lp = reference_logprobs(path, ids, dense=dense, params=params, prompt_len=len(prompt_ids))[-1]
        tok = int(lp.argmax())
        new.append(tok)
        lps.append(float(lp[tok]))
        ids.append(tok)
    return new, lps
