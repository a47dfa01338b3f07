"""``python -m dash_core.tiny_checkpoint``: the user tool that writes a tiny DASH Llama with its tokenizer."""

import json
import os
import string
import subprocess
import sys

import pytest
import torch

from dash_core import DashParams
from tests.tiny_dash_llama import reference_logprobs

pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")


def _tool(cwd, *args, prelude: str = ""):
    """Run the tool in a fresh interpreter whose working directory is ``cwd`` (not the repository)."""
    code = f"{prelude}import sys; from dash_core.tiny_checkpoint import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_writes_the_shapes_asked_for_and_a_working_tokenizer(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dash_core.tiny_checkpoint", "ckpt", "--layers", "1", "--heads", "6",
                        "--kv-heads", "3", "--head-dim", "16", "--context", "4096", "--block-size", "32",
                        "--topk", "3", "--scaling-factor", "2.5", "--seed", "4"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "DASH block size 32" in r.stdout
    path = tmp_path / "ckpt"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DashLlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["max_position_embeddings"]) == (1, 6, 3, 16, 4096)
    p = DashParams.from_config(cfg)
    assert (p.block_size, p.topk, p.scaling_factor) == (32, 3, 2.5)
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    assert sd["model.layers.0.self_attn.indexer_q"].shape == (3 * 16,)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (6 * 16, cfg["hidden_size"])
    assert "model.layers.1.self_attn.q_proj.weight" not in sd
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode("DASH routes!").ids
    assert ids == [3 + string.printable.index(c) for c in "DASH routes!"]  # one id per character
    assert tok.decode(ids) == "DASH routes!"
    # the reference forward runs on it: one distribution over the vocabulary per token
    lp = reference_logprobs(str(path), ids)
    assert lp.shape == (len(ids), cfg["vocab_size"])
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(len(ids), dtype=torch.float64))


def test_same_seed_same_weights(tmp_path):
    for name in ("a", "b"):
        assert _tool(tmp_path, name, "--topk", "2").returncode == 0
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, message", [
    (("--heads", "3"), "num_attention_heads = 3 is not allowed: expected a multiple of num_key_value_heads (2)"),
    (("--block-size", "24"), "block_size = 24 is not allowed: expected a power of two in 16..256"),
    (("--topk", "0"), "topk = 0 is not allowed"),
])
def test_bad_options_fail_with_one_line(tmp_path, args, message):
    r = _tool(tmp_path, "bad", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bad").exists()


def test_without_tokenizers_it_fails_naming_the_extra(tmp_path):
    """No silent checkpoint without a tokenizer: the engines would fail later, on the tokenizer."""
    r = _tool(tmp_path, "ckpt", prelude="import sys; sys.modules['tokenizers'] = None; ")
    assert r.returncode == 2
    assert "needs 'tokenizers'" in r.stderr and "pip install 'dash-serve[tiny]'" in r.stderr
    assert not os.path.exists(tmp_path / "ckpt" / "config.json")
