"""SGLang plugin: ``--attention-backend dash`` and the DASH Llama model, without editing SGLang.

Entry point (``pyproject.toml``)::

    [project.entry-points."sglang.srt.plugins"]
    dash = "adapters.sglang.plugin:register"

SGLang runs ``register()`` once in every process it starts (server, scheduler, detokenizer),
so ``python -m sglang.launch_server ... --attention-backend dash`` and
``sgl.Engine(..., attention_backend="dash")`` both find the backend. ``register()``:

- adds ``dash`` to SGLang's closed list of ``--attention-backend`` choices;
- registers the backend factory (the backend module is imported only where a model runs);
- registers ``adapters.sglang.models`` out of tree (``DashLlamaForCausalLM``); importing that
  package also hooks SGLang's KV-pool sizing so that the DASH summary store is counted per token;
- wraps a step of SGLang's server-argument resolution with the start-up checks of
  ``adapters.sglang.startup`` (the serving rule, the page size, ...), which run where the arguments are
  parsed, before the scheduler process loads the weights.

Plugins run in every SGLang process, also in those that never load a model (tokenizer,
detokenizer), so ``register()`` stays light: when SGLang's model registry is not imported yet it
sets ``SGLANG_EXTERNAL_MODEL_PACKAGE=adapters.sglang.models`` (if unset), which makes SGLang import
that package when the registry is first imported and load its own models on demand. Otherwise
it registers the package with ``ModelRegistry.register``.

SGLang logs and swallows exceptions raised by plugins; ``registered()`` says whether
registration took effect.
"""

from __future__ import annotations

import logging
import math
import os
import sys

logger = logging.getLogger(__name__)

BACKEND_NAME = "dash"
SGLANG_TESTED = "0.5.23"
MODELS_PACKAGE = "adapters.sglang.models"
EXTERNAL_MODELS_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
_CELL_SIZE_TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
_hooked = False


def register() -> None:
    """Register the ``dash`` attention backend and the DASH Llama model with SGLang (idempotent)."""
    try:
        import sglang
    except ImportError as e:  # pragma: no cover - the entry point only runs inside SGLang
        raise RuntimeError("the SGLang adapter needs SGLang: pip install 'dash-serve[sglang]'") from e
    version = getattr(sglang, "__version__", "unknown")
    if version != SGLANG_TESTED:
        logger.warning("DASH's SGLang adapter is tested with sglang %s; this is sglang %s",
                       SGLANG_TESTED, version)

    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(_create_backend)
    _register_models()
    from .startup import register_checks

    register_checks()


def _register_models() -> None:
    if "sglang.srt.models.registry" not in sys.modules:
        if not os.environ.get(EXTERNAL_MODELS_ENV):
            os.environ[EXTERNAL_MODELS_ENV] = MODELS_PACKAGE
        if os.environ[EXTERNAL_MODELS_ENV] == MODELS_PACKAGE:
            return
    from sglang.srt.models.registry import ModelRegistry

    if "DashLlamaForCausalLM" not in ModelRegistry.models:
        ModelRegistry.register(MODELS_PACKAGE, overwrite=True, strict=True)


def registered() -> bool:
    """True when ``dash`` is an ``--attention-backend`` choice and a registered backend."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return BACKEND_NAME in ATTENTION_BACKEND_CHOICES and BACKEND_NAME in ATTENTION_BACKENDS


def _create_backend(model_runner):
    from .backend import DashAttnBackend

    return DashAttnBackend(model_runner)


def uses_dash(server_args) -> bool:
    """Whether any attention backend of ``server_args`` (full, prefill or decode) is ``dash``."""
    names = (getattr(server_args, a, None) for a in
             ("attention_backend", "prefill_attention_backend", "decode_attention_backend"))
    return BACKEND_NAME in names


def add_summary_bytes(cell_size: int, kvc, num_layers: int) -> int:
    """``cell_size`` (KV bytes per token over all layers) plus the DASH summary store's and the
    auxiliary head's share.

    The store keeps one ``[Hkv, D]`` summary per block of ``block_size`` slots per layer, in the
    KV dtype: ``Hkv * D * itemsize / block_size`` bytes per token and layer (``1 / (2 bs)`` of K+V);
    with an indexer one ``[1, D]`` summary of ``ik``. A model with an indexer or page mode also keeps
    the auxiliary head, ``2 D`` elements per token and layer (``1 / Hkv`` of K+V).
    """
    if num_layers == 0 or not uses_dash(kvc.server_args):
        return cell_size
    import torch

    from dash_core.layout import aux_bytes_per_token, summary_bytes_per_token
    from dash_core.model_config import AuxConfig
    from dash_core.params import DashParams
    from sglang.srt.runtime_context import get_parallel

    mc = kvc.model_config
    bs = DashParams.from_config(mc.hf_config).block_size
    aux = AuxConfig.from_config(mc.hf_config)
    hkv = mc.get_num_kv_heads(get_parallel().attn_tp_size)
    dtype = kvc.kv_cache_dtype if isinstance(kvc.kv_cache_dtype, torch.dtype) else torch.float32
    heads = aux.summary_heads or hkv
    extra = summary_bytes_per_token(bs, heads, mc.head_dim, dtype) * num_layers
    if aux.needs_aux:
        extra += aux_bytes_per_token(hkv, mc.head_dim, dtype) * num_layers
    return cell_size + math.ceil(extra)  # round up: never under-count


def hook_memory_accounting() -> None:
    """AFTER hook on SGLang's per-token KV cost, so the pool is sized with the summary store."""
    global _hooked
    if _hooked:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after(result, self, kvc, num_layers, *args, **kwargs):
        return add_summary_bytes(result, kvc, num_layers)

    HookRegistry.register(_CELL_SIZE_TARGET, after, HookType.AFTER)
    HookRegistry.apply_hooks()  # load_plugins() applies hooks too; this covers a direct register()
    _hooked = True
