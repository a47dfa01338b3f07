"""Registration level: the ``sglang.srt.plugins`` entry point, ``--attention-backend dash`` parsing,
the out-of-tree model, and the summary store's share of SGLang's per-token KV cost."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from tests.engines._sglang_support import budget, fake_tp

_budget = budget("plugin", 60)

ARGS = ["--model-path", "unused-model-dir", "--device", "cpu", "--attention-backend", "dash"]


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert [e.value for e in eps if e.name == "dash"] == ["adapters.sglang.plugin:register"]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, **env))


_PARSE = f"""
from sglang.srt.plugins import load_plugins
load_plugins()
from adapters.sglang.plugin import registered
from sglang.srt.server_args import prepare_server_args
assert registered(), "load_plugins() did not register dash"
args = prepare_server_args({ARGS!r})
print("backend=" + args.attention_backend)
"""


def test_load_plugins_registers_dash_and_the_cli_parses_it():
    """In a fresh process, as SGLang starts one: load_plugins() -> dash is a choice and a backend."""
    r = _run(_PARSE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backend=dash" in r.stdout


def test_without_the_plugin_dash_is_an_invalid_choice():
    """The negative control: with the plugin filtered out, SGLang's CLI rejects dash."""
    code = _PARSE.replace('assert registered(), "load_plugins() did not register dash"', "")
    r = _run(code, SGLANG_PLUGINS="some-other-plugin")
    assert r.returncode != 0
    assert "invalid choice: 'dash'" in r.stderr


def test_register_is_idempotent_and_registers_the_model():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    from adapters.sglang.plugin import register, registered

    register()
    register()
    assert registered() and ATTENTION_BACKEND_CHOICES.count("dash") == 1
    from sglang.srt.models.registry import ModelRegistry

    from adapters.sglang.models.dash_llama import DashLlamaForCausalLM

    cls, arch = ModelRegistry.resolve_model_cls(["DashLlamaForCausalLM"])
    assert cls is DashLlamaForCausalLM and arch == "DashLlamaForCausalLM"


def _kvc(backend: str, dtype=torch.bfloat16, chunk_size=16, **config):
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(chunk_size=chunk_size, **config),
                                         head_dim=128, get_num_kv_heads=lambda tp: 8 // tp)
    return types.SimpleNamespace(server_args=types.SimpleNamespace(attention_backend=backend),
                                 model_config=model_config, kv_cache_dtype=dtype)


def test_summary_store_bytes_are_added_to_the_kv_cell_size():
    from adapters.sglang.plugin import add_summary_bytes

    layers = 32
    kv_cell = 8 * (128 + 128) * layers * 2  # SGLang's K+V bytes per token: Hkv * (D + Dv) * layers * bf16
    with fake_tp(1, 0):
        got = add_summary_bytes(kv_cell, _kvc("dash"), layers)
        # One [Hkv, D] bf16 summary per 16 tokens and layer: 8 * 128 * 2 / 16 = 128 bytes per token and layer,
        # 1 / (2 * 16) of the K+V bytes (docs/semantics.md section 8).
        assert got - kv_cell == 128 * layers == kv_cell // 32
        assert add_summary_bytes(kv_cell, _kvc("torch_native"), layers) == kv_cell
    with fake_tp(2, 0):  # KV heads (and summaries) are split across TP ranks
        assert add_summary_bytes(kv_cell // 2, _kvc("dash"), layers) - kv_cell // 2 == 64 * layers


def test_aux_head_and_indexer_summaries_are_counted_in_the_kv_cell_size():
    """docs/semantics.md section 9: an indexer model keeps one [1, D] summary of ik per block and the auxiliary head
    (2 D elements per token and layer); page mode alone keeps the auxiliary head next to the [Hkv, D] store."""
    from adapters.sglang.plugin import add_summary_bytes

    layers = 32
    kv_cell = 8 * (128 + 128) * layers * 2
    aux_row = 2 * 128 * 2  # [2D] bf16 per token and layer: 1 / Hkv of K+V
    page = dict(dash_page_mode=True, dash_page_start_token_id=5, dash_page_token_id=6)
    with fake_tp(1, 0):
        got = add_summary_bytes(kv_cell, _kvc("dash", dash_indexer_heads=4), layers)
        assert got - kv_cell == (128 * 2 // 16 + aux_row) * layers  # 16 + 512 bytes per token and layer
        got = add_summary_bytes(kv_cell, _kvc("dash", **page), layers)
        assert got - kv_cell == (128 + aux_row) * layers
        assert aux_row * layers == kv_cell // 8
        assert add_summary_bytes(kv_cell, _kvc("torch_native", dash_indexer_heads=4), layers) == kv_cell


def test_pool_sizing_hook_is_applied_when_the_models_load():
    """Importing the model package (SGLang does it before sizing the KV pool) hooks _compute_cell_size: SGLang's own
    computation of a plain GQA model's cell (stand-ins for what it reads of the configurator), plus the summary
    store's bytes with the dash backend, and nothing more with another."""
    import adapters.sglang.models
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    fn = DefaultPoolConfigurator._compute_cell_size
    assert hasattr(fn, "__wrapped__"), "the DASH pool-sizing hook is not applied"
    configurator = types.SimpleNamespace(kv_cache_dtype_str="auto",
                                         _compute_qsa_cell_size=DefaultPoolConfigurator._compute_qsa_cell_size)

    def kvc(backend):
        c = _kvc(backend, architectures=["DashLlamaForCausalLM"])
        c.model_config.v_head_dim = 128
        c.model_config.get_num_kv_heads = lambda tp, dcp=1: 8 // tp
        c.server_args.enable_hisparse = False
        c.use_mla_backend = c.is_draft_worker = False
        return c

    layers = 32
    with fake_tp(1, 0, attn_dcp_size=1, enable_dsa_cache_layer_split=False):
        kv_cell = fn.__wrapped__(configurator, kvc("dash"), layers)
        assert kv_cell == 8 * (128 + 128) * layers * 2  # SGLang's K+V bytes per token, bf16
        assert fn(configurator, kvc("dash"), layers) - kv_cell == 128 * layers  # [8, 128] bf16 a block of 16
        assert fn(configurator, kvc("torch_native"), layers) == kv_cell
