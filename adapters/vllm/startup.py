"""Start-up checks of a DASH model in vLLM that need only the engine configuration and the model config.

They run twice, before anything loads:

- ``verify_config`` is the ``verify_and_update_config`` of the DASH architectures in vLLM's per-architecture
  config hooks (``MODELS_CONFIG_MAP``, filled by the plugin), which vLLM calls while it builds the engine
  configuration in the process that parsed the arguments (``LLM(...)``, the OpenAI server), before it starts
  the engine-core and worker processes that load the weights;
- ``check_command_line`` is what ``python -m adapters.vllm.serve`` checks from the command line and the
  model's ``config.json`` before it hands over to vLLM's OpenAI server (seconds after the start). It also
  covers what vLLM never shows a plugin: ``--attention-backend CUSTOM`` for a model that is not a DASH model
  on the CPU, where vLLM's CPU platform replaces any requested backend by its own ``CPU_ATTN``.

The rule is ``dash_core.model_config.check_attention_choice`` (the SGLang adapter applies the same one); the
DASH model also needs ``--block-size`` equal to its DASH block size (``chunk_size``): the backend keeps one
DASH block per KV page, the block's summary in the page.

No vLLM import at module level: the serve entry point runs these checks before importing vLLM.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from dash_core.model_config import AuxConfig, check_attention_choice, is_dash_model, serving_params
from dash_core.params import DashParams

logger = logging.getLogger(__name__)

CUSTOM = "CUSTOM"  # vLLM's placeholder backend member that the plugin points at DASH
DASH_FLAG = "--attention-backend CUSTOM (or leave --attention-backend out)"


def block_size_error(vllm_block_size: int, params: DashParams) -> ValueError:
    """The start-up error for a vLLM block size other than the DASH block size."""
    return ValueError(
        f"page size must be a multiple of the DASH block size, and the vLLM DASH backend keeps exactly one "
        f"DASH block per KV page (its summary lives in the page): --block-size is {vllm_block_size}, DASH block "
        f"size (chunk_size) is {params.block_size}; set --block-size {params.block_size}")


def check_block_size(block_size: Optional[int], params: DashParams) -> None:
    """``--block-size`` must be given and equal the DASH block size (``block_size`` None: not given)."""
    if block_size is None:
        raise ValueError(f"serving a DASH model in vLLM needs --block-size {params.block_size} (the checkpoint's "
                         f"DASH block size, chunk_size): the backend keeps one DASH block per KV page, and without "
                         f"the flag vLLM picks a block size of its own (128 on the CPU)")
    if block_size != params.block_size:
        raise block_size_error(block_size, params)


def dash_attention_chosen(hf_config: Any, backend: Optional[str]) -> bool:
    """Whether the DASH layers run: ``--attention-backend CUSTOM``, or none named (``backend`` None or
    ``auto``) for a DASH model (whose layers are built on the DASH backend by ``DashLlamaForCausalLM``)."""
    name = None if backend is None or str(backend).lower() == "auto" else str(backend).upper()
    return name == CUSTOM or (name is None and is_dash_model(hf_config))


def check_choice(hf_config: Any, backend: Optional[str]) -> bool:
    """The serving rule for vLLM's ``--attention-backend`` value ``backend`` (None or ``auto``: vLLM
    selects); True when a DASH model starts dense because ``DASH_ALLOW_DENSE`` allows it."""
    chosen = (f"--attention-backend {backend}" if backend is not None and str(backend).lower() != "auto"
              else "vLLM's own backend selection")
    return check_attention_choice(hf_config, dash_attention_chosen(hf_config, backend), chosen, DASH_FLAG)


def verify_config(vllm_config: Any) -> None:
    """vLLM's per-architecture config hook for the DASH models (see the module docstring).

    Raises ``ValueError`` for a start that cannot work: the serving rule, the DASH keys and
    ``DASH_ATTENTION_BACKEND`` (``serving_params``), the auxiliary-head keys, ``--block-size``, router
    ``shared`` under tensor parallelism. The dense start that ``DASH_ALLOW_DENSE=1`` allows is logged as a
    warning.
    """
    model_config = vllm_config.model_config
    if model_config is None:
        return
    hf_config = model_config.hf_config
    attention = vllm_config.attention_config
    backend = (getattr(attention, "backend_per_kind", None) or {}).get("full_attention", attention.backend)
    name = None if backend is None else backend.name
    if check_choice(hf_config, name):
        logger.warning("DASH_ALLOW_DENSE=1: serving the DASH model %s with vLLM's dense %s attention, which is not "
                       "the model it was trained as; for comparisons only", model_config.model, name)
        return
    params = serving_params(hf_config)
    AuxConfig.from_config(hf_config)  # the indexer and page-mode keys
    cache = vllm_config.cache_config
    check_block_size(cache.block_size if getattr(cache, "user_specified_block_size", True) else None, params)
    tp = vllm_config.parallel_config.tensor_parallel_size
    if params.router == "shared" and tp > 1:
        raise ValueError(f"DASH router 'shared' is not supported with tensor parallelism ({tp}): it averages "
                         f"routing over all query heads, which TP splits across ranks; use router 'kv_head' or "
                         f"tensor_parallel_size=1")


def _command_line_config(args: Any) -> Optional[Any]:
    """The model's HF config for the parsed command line (with ``--hf-overrides`` applied), or None when it
    cannot be read here (vLLM then reports the model itself)."""
    import json

    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code,
                                            revision=args.revision)
    except Exception as e:
        logger.debug("no early DASH check: the config of %s cannot be read here (%s)", args.model, e)
        return None
    if args.hf_overrides:
        try:
            overrides = json.loads(args.hf_overrides)
        except ValueError:
            overrides = None
        for key, value in (overrides or {}).items() if isinstance(overrides, dict) else ():
            setattr(config, key, value)
    return config


def check_command_line(argv: list) -> None:
    """The checks of ``python -m adapters.vllm.serve`` on vLLM server arguments ``argv`` (module docstring).

    Reads ``--model``, ``--attention-backend``, ``--block-size``, ``--hf-overrides``, ``--trust-remote-code``
    and ``--revision`` (both ``--flag value`` and ``--flag=value``); every other argument is vLLM's. Raises
    ``ValueError`` naming the flag to change.
    """
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", default=None)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--hf-overrides", default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--revision", default=None)
    args, _ = parser.parse_known_args(argv)
    if args.model is None:
        return
    config = _command_line_config(args)
    if config is None:
        return
    if check_choice(config, args.attention_backend) or not dash_attention_chosen(config, args.attention_backend):
        return
    check_block_size(args.block_size, serving_params(config))
