"""A tiny random DASH Llama checkpoint, and a plain PyTorch forward of it that calls the oracle.

Both engines load the checkpoint this writes (safetensors + config + an offline char-level
tokenizer); the engine tests compare their log-probabilities and greedy tokens with
``reference_logprobs`` / ``reference_generate``. Weights use a large init scale so that
attention is far from uniform (a dummy-weights model cannot catch attention bugs).

Options for the auxiliary head (docs/semantics.md section 9):

- ``indexer_heads = Hi``: every layer gets an indexer (config ``dash_indexer_heads``), weights
  ``model.layers.{i}.self_attn.dash_indexer.wq.weight [Hi * D, hidden]``, ``...wk.weight [D, hidden]``
  and ``...head_cls [D]``; ``iq = wq(x)``, ``ik = wk(x)`` on the layer's normed input, rotated like
  q and k (same theta and head size), and routing uses them (the shared selection).
- ``page_mode = True`` (config ``dash_page_mode``, ``dash_page_start_token_id``,
  ``dash_page_token_id``, ``dash_page_rope_tok_pairs``): prompt tokens equal to the page-start id
  get role 1, those equal to the page-token id role 2, the rest role 0; generated tokens role 0.
  q, k (and iq, ik) get page RoPE at the coordinates ``dash_core.rope.page_coordinates`` gives.

The indexer weights are drawn after every other weight, so an indexer model's other weights equal
those of the plain model of the same seed.

    python -m tests.tiny_dash_llama OUT_DIR [--chunk-size 16] [--scaling-factor 4] [--indexer-heads 2]
        [--page-mode] ...
"""

from __future__ import annotations

import argparse
import json
import os
import string
from typing import Optional

import torch

from dash_core import DashParams, dash_reference
from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope

DEFAULTS = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, initializer_range=0.25,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    hidden_act="silu", attention_bias=False, mlp_bias=False,
    # DASH keys under their published names (docs/semantics.md section 1)
    chunk_size=16, scaling_factor=1.0, sigma=1e6, estimate_diagonal=False,
)
# Page placeholder ids of page-mode checkpoints: the last two ids of the vocabulary (never produced
# by the char-level tokenizer, so prompts carry them as token ids).
PAGE_START_TOKEN_ID = DEFAULTS["vocab_size"] - 2
PAGE_TOKEN_ID = DEFAULTS["vocab_size"] - 1


def write_checkpoint(path: str, seed: int = 0, *, indexer_heads: Optional[int] = None, page_mode: bool = False,
                     page_start_token_id: Optional[int] = None, page_token_id: Optional[int] = None,
                     page_rope_tok_pairs: Optional[int] = None, **overrides) -> dict:
    """Write a seeded random DASH Llama to ``path``; returns its config dict.

    ``overrides`` replace config keys (including ``dash_topk``, ``dash_local``, ``dash_router``).
    The per-layer DASH weight is saved under the published name
    ``model.layers.{i}.self_attn.indexer_q`` as a flat ``[Hkv * D]`` vector.
    indexer_heads: ``Hi`` for a model with an indexer (None: none). page_mode: a page-mode model whose
    placeholders are ``page_start_token_id`` / ``page_token_id`` (default: the last two vocabulary ids)
    and whose page RoPE split is ``page_rope_tok_pairs`` (None: a quarter of the head size).
    """
    cfg = dict(DEFAULTS, **overrides)
    if indexer_heads is not None:
        if indexer_heads < 1:
            raise ValueError(f"indexer_heads must be None or >= 1, got {indexer_heads}")
        cfg["dash_indexer_heads"] = indexer_heads
    if page_mode:
        vocab = cfg["vocab_size"]
        cfg.update(dash_page_mode=True,
                   dash_page_start_token_id=vocab - 2 if page_start_token_id is None else page_start_token_id,
                   dash_page_token_id=vocab - 1 if page_token_id is None else page_token_id,
                   dash_page_rope_tok_pairs=page_rope_tok_pairs)
    cfg.update(architectures=["DashLlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    hid, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*shape, scale=std):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    sd = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], hid, scale=1.0),
          "model.norm.weight": 1 + rnd(hid, scale=0.1), "lm_head.weight": rnd(cfg["vocab_size"], hid)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = 1 + rnd(hid, scale=0.1)
        sd[pre + "post_attention_layernorm.weight"] = 1 + rnd(hid, scale=0.1)
        sd[pre + "self_attn.q_proj.weight"] = rnd(hq * hd, hid)
        sd[pre + "self_attn.k_proj.weight"] = rnd(hkv * hd, hid)
        sd[pre + "self_attn.v_proj.weight"] = rnd(hkv * hd, hid)
        sd[pre + "self_attn.o_proj.weight"] = rnd(hid, hq * hd, scale=std / 2)
        sd[pre + "self_attn.indexer_q"] = rnd(hkv * hd, scale=1.0)
        sd[pre + "mlp.gate_proj.weight"] = rnd(inter, hid)
        sd[pre + "mlp.up_proj.weight"] = rnd(inter, hid)
        sd[pre + "mlp.down_proj.weight"] = rnd(hid, inter, scale=std / 2)
    for i in range(cfg["num_hidden_layers"]) if indexer_heads is not None else ():
        pre = f"model.layers.{i}.self_attn.dash_indexer."
        sd[pre + "wq.weight"] = rnd(indexer_heads * hd, hid)
        sd[pre + "wk.weight"] = rnd(hd, hid)
        sd[pre + "head_cls"] = rnd(hd, scale=1.0)
    from safetensors.torch import save_file

    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f)
    _write_tokenizer(path, cfg["vocab_size"])
    return cfg


def _write_tokenizer(path: str, vocab_size: int) -> None:
    """A char-level WordLevel tokenizer that works offline (skipped if ``tokenizers`` is absent)."""
    try:
        import tokenizers
    except ImportError:
        return
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in string.printable[:95]:
        vocab.setdefault(ch, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 1 << 20}, f)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-size", type=int, default=DEFAULTS["chunk_size"])
    ap.add_argument("--scaling-factor", type=float, default=DEFAULTS["scaling_factor"])
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--indexer-heads", type=int, default=None)
    ap.add_argument("--page-mode", action="store_true")
    args = ap.parse_args()
    extra = {} if args.topk is None else {"dash_topk": args.topk}
    cfg = write_checkpoint(args.out, seed=args.seed, chunk_size=args.chunk_size,
                           scaling_factor=args.scaling_factor, indexer_heads=args.indexer_heads,
                           page_mode=args.page_mode, **extra)
    print(f"wrote {args.out}: {cfg['num_hidden_layers']} layers, block size {cfg['chunk_size']}")


if __name__ == "__main__":
    main()
