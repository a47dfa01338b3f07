"""Write a tiny random DASH Llama checkpoint that both engines load.

    python -m dash_core.tiny_checkpoint OUT [--layers 2] [--heads 4] [--kv-heads 2] [--head-dim 32]
        [--hidden-size 128] [--context 2048] [--block-size 16] [--topk K] [--scaling-factor 1.0]
        [--indexer-heads HI] [--page-mode] [--seed 0]

``OUT`` gets ``config.json`` (``"architectures": ["DashLlamaForCausalLM"]`` and the DASH keys of
docs/semantics.md section 1), ``model.safetensors`` (the per-layer DASH weight under its published
name ``model.layers.{i}.self_attn.indexer_q``, a flat ``[Hkv * D]`` vector), ``generation_config.json``
and an offline char-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``). It needs
``safetensors`` and ``tokenizers`` (the ``tiny`` extra: ``pip install 'dash-serve[tiny]'``) and fails
naming that extra when either is missing. The engine environments carry both.

The weights are seeded and drawn with a large scale, so attention is far from uniform: a wrong
attention changes the greedy tokens (the engine tests compare them with a float64 reference model).
The checkpoint is for trying the serving commands and for tests, not a language model: its text is noise.

Options for the auxiliary head (docs/semantics.md section 9):

- ``indexer_heads = Hi``: every layer gets an indexer (config ``dash_indexer_heads``), weights
  ``model.layers.{i}.self_attn.dash_indexer.wq.weight [Hi * D, hidden]``, ``...wk.weight [D, hidden]``
  and ``...head_cls [D]``, drawn after every other weight (so the other weights equal those of the plain
  model of the same seed).
- ``page_mode = True`` (config ``dash_page_mode``, ``dash_page_start_token_id``, ``dash_page_token_id``,
  ``dash_page_rope_tok_pairs``): the placeholder ids default to the last two ids of the vocabulary, which
  the char-level tokenizer never produces (prompts carry them as token ids).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import string
import sys
from typing import Optional

import torch

from dash_core.params import DashParams

EXTRA = "tiny"  # the pyproject extra that brings safetensors and tokenizers

DEFAULTS = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, initializer_range=0.25,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    hidden_act="silu", attention_bias=False, mlp_bias=False,
    # DASH keys under their published names (docs/semantics.md section 1)
    chunk_size=16, scaling_factor=1.0, sigma=1e6, estimate_diagonal=False,
)
# Page placeholder ids of page-mode checkpoints: the last two ids of the vocabulary.
PAGE_START_TOKEN_ID = DEFAULTS["vocab_size"] - 2
PAGE_TOKEN_ID = DEFAULTS["vocab_size"] - 1
# The tokenizer's ids: three special tokens, then the 95 printable ASCII characters.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
MIN_VOCAB = len(SPECIAL_TOKENS) + 95


def _need(module: str):
    """Import an optional dependency of the writer, or raise naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"dash_core.tiny_checkpoint needs {module!r} to write the checkpoint: "
                           f"pip install 'dash-serve[{EXTRA}]'") from e


def _check(cfg: dict) -> None:
    """ValueError naming the config key for shapes the engines would refuse later."""
    def positive(key):
        v = cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{key} = {v!r} is not allowed: expected an integer >= 1")

    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                "intermediate_size", "max_position_embeddings", "vocab_size"):
        positive(key)
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if hq % hkv:
        raise ValueError(f"num_attention_heads = {hq} is not allowed: expected a multiple of "
                         f"num_key_value_heads ({hkv})")
    if cfg["head_dim"] % 2:
        raise ValueError(f"head_dim = {cfg['head_dim']} is not allowed: expected an even number (RoPE pairs)")
    if cfg["vocab_size"] < MIN_VOCAB:
        raise ValueError(f"vocab_size = {cfg['vocab_size']} is not allowed: expected >= {MIN_VOCAB} "
                         f"(the char-level tokenizer's ids)")
    DashParams.from_config(cfg)  # the DASH keys (ValueError naming the field)


def write_checkpoint(path: str, seed: int = 0, *, indexer_heads: Optional[int] = None, page_mode: bool = False,
                     page_start_token_id: Optional[int] = None, page_token_id: Optional[int] = None,
                     page_rope_tok_pairs: Optional[int] = None, **overrides) -> dict:
    """Write a seeded random DASH Llama with its tokenizer to ``path``; returns its config dict.

    Parameters
    ----------
    path : str
        Output directory (created if missing).
    seed : int
        Seed of every weight.
    indexer_heads : int, optional
        ``Hi`` for a model with an indexer (None: none).
    page_mode : bool
        A page-mode model whose placeholders are ``page_start_token_id`` / ``page_token_id`` (default:
        the last two vocabulary ids) and whose page RoPE split is ``page_rope_tok_pairs`` (None: a quarter
        of the head size).
    **overrides
        Config keys replacing ``DEFAULTS`` (``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``, ``chunk_size``, ``dash_topk``,
        ``dash_local``, ``dash_router``, ...).

    Returns
    -------
    dict
        The config written to ``config.json``. Weights are float32; ``indexer_q`` is flat ``[Hkv * D]``.

    Raises
    ------
    ValueError
        For a config the engines would refuse (naming the key).
    RuntimeError
        When ``safetensors`` or ``tokenizers`` is missing (naming the extra ``tiny``).
    """
    safetensors_torch = _need("safetensors.torch")
    _need("tokenizers")
    cfg = dict(DEFAULTS, **overrides)
    if indexer_heads is not None:
        if not isinstance(indexer_heads, int) or indexer_heads < 1:
            raise ValueError(f"indexer_heads = {indexer_heads!r} is not allowed: expected None or an integer >= 1")
        cfg["dash_indexer_heads"] = indexer_heads
    if page_mode:
        vocab = cfg["vocab_size"]
        cfg.update(dash_page_mode=True,
                   dash_page_start_token_id=vocab - 2 if page_start_token_id is None else page_start_token_id,
                   dash_page_token_id=vocab - 1 if page_token_id is None else page_token_id,
                   dash_page_rope_tok_pairs=page_rope_tok_pairs)
    cfg.update(architectures=["DashLlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    _check(cfg)
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
    safetensors_torch.save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f)
    write_tokenizer(path, cfg["vocab_size"])
    return cfg


def write_tokenizer(path: str, vocab_size: int) -> None:
    """Write a char-level WordLevel tokenizer of ``vocab_size`` ids that works offline.

    Ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the 95 printable ASCII characters from 3 on, then
    ``<extra_N>`` placeholders up to ``vocab_size``. Raises ``RuntimeError`` naming the extra ``tiny``
    when ``tokenizers`` is missing.
    """
    tokenizers = _need("tokenizers")
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
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


def _parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    ap = argparse.ArgumentParser(prog="python -m dash_core.tiny_checkpoint",
                                 description="Write a tiny random DASH Llama checkpoint (with a char-level "
                                             "tokenizer) that SGLang and vLLM serve with DASH attention.")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--layers", type=int, default=d["num_hidden_layers"], help="decoder layers")
    ap.add_argument("--heads", type=int, default=d["num_attention_heads"], help="query heads Hq")
    ap.add_argument("--kv-heads", type=int, default=d["num_key_value_heads"], help="KV heads Hkv (divides Hq)")
    ap.add_argument("--head-dim", type=int, default=d["head_dim"], help="head size D")
    ap.add_argument("--hidden-size", type=int, default=d["hidden_size"], help="model width")
    ap.add_argument("--context", type=int, default=d["max_position_embeddings"],
                    help="max_position_embeddings (the engines' default context length)")
    ap.add_argument("--block-size", type=int, default=d["chunk_size"],
                    help="DASH block size (config chunk_size): the engines' page size must fit it")
    ap.add_argument("--topk", type=int, default=None, help="cap on routed blocks (dash_topk); default none")
    ap.add_argument("--scaling-factor", type=float, default=d["scaling_factor"], help="routing temperature")
    ap.add_argument("--indexer-heads", type=int, default=None, help="route with an indexer of this many heads")
    ap.add_argument("--page-mode", action="store_true", help="a page-mode model")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: Optional[list] = None) -> int:
    """The command line above; returns the exit status (2 with a one-line error for bad options)."""
    args = _parser().parse_args(argv)
    extra = {} if args.topk is None else {"dash_topk": args.topk}
    try:
        cfg = write_checkpoint(args.out, seed=args.seed, num_hidden_layers=args.layers,
                               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                               head_dim=args.head_dim, hidden_size=args.hidden_size,
                               max_position_embeddings=args.context, chunk_size=args.block_size,
                               scaling_factor=args.scaling_factor, indexer_heads=args.indexer_heads,
                               page_mode=args.page_mode, **extra)
    except (ValueError, RuntimeError) as e:
        sys.stderr.write(f"dash_core.tiny_checkpoint: error: {e}\n")
        return 2
    sys.stdout.write(f"wrote {args.out}: {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads, "
                     f"{cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}, context "
                     f"{cfg['max_position_embeddings']}, DASH block size {cfg['chunk_size']} (serve it with "
                     f"--page-size / --block-size {cfg['chunk_size']}), topk {cfg.get('dash_topk')}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
