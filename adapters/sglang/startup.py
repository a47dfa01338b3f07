"""Start-up checks of a DASH server that need only the server arguments and the model config.

SGLang resolves its server arguments in the process that parses them (``launch_server``'s main process,
or the caller of ``sgl.Engine``), before it spawns the scheduler that loads the weights. The plugin wraps
one step of that resolution (SGLang's ``register_resolution_hook``, for the step
``handle_model_capability_adjustments``, after which the attention backends and the page size are final)
with ``check_server_args``, so a start that cannot work stops there with one clear error instead of after
the model load:

- the serving rule of ``dash_core.model_config.check_attention_choice``: a DASH checkpoint needs
  ``--attention-backend dash`` (``DASH_ALLOW_DENSE=1`` allows its dense attention, for comparisons), and
  ``dash`` needs a DASH checkpoint;
- with ``dash``: one backend for prefill and decode, the DASH keys and ``DASH_ATTENTION_BACKEND``
  (``serving_params``), the auxiliary-head keys (``AuxConfig``), ``--page-size`` a multiple of the DASH
  block size, no speculative decoding, and page mode's chunking (``page_mode_problems``).

``DashAttnBackend`` repeats the checks that concern it when the scheduler builds it (it can also be built
outside a server, e.g. by SGLang's attention test kit).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

BACKEND_NAME = "dash"
DASH_FLAG = "--attention-backend dash"
RESOLUTION_STEP = "handle_model_capability_adjustments"  # a late step: backends and page size are final
_registered = False


def register_checks() -> None:
    """Wrap SGLang's resolution step with ``check_server_args`` (once per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    @register_resolution_hook(RESOLUTION_STEP)
    def _dash_checks(server_args, previous):
        previous(server_args)
        check_server_args(server_args)

    _registered = True


def page_mode_problems(chunked_prefill_size: Optional[int], context_len: Optional[int],
                       enable_mixed_chunk: bool) -> list:
    """Why SGLang's chunking cannot serve a page-mode model, as ``(what, why)`` pairs (none when it can):
    each prompt must be prefilled in one chunk and extend batches must not carry decode tokens."""
    problems = []
    chunk = chunked_prefill_size
    if chunk is not None and chunk > 0 and (context_len is None or chunk < context_len):
        problems.append((f"page mode (dash_page_mode) with --chunked-prefill-size {chunk}",
                         f"a page-mode prompt must be prefilled in one chunk (the coordinates of its text depend on "
                         f"the whole prompt); pass --chunked-prefill-size -1 (or at least the context length "
                         f"{context_len})"))
    if enable_mixed_chunk:
        problems.append(("page mode with --enable-mixed-chunk",
                         "decode tokens inside an extend batch would take roles from their ids"))
    return problems


def reject(what: str, why: str) -> ValueError:
    """The error of an unsupported start: ``attention backend 'dash' does not support WHAT: WHY``."""
    return ValueError(f"attention backend 'dash' does not support {what}: {why}")


def check_server_args(server_args: Any) -> None:
    """Raise ``ValueError`` for a DASH start that cannot work (the module docstring's list), from the resolved
    server arguments and the model config; log a warning for an allowed dense start of a DASH checkpoint."""
    from dash_core.layout import check_page_size
    from dash_core.model_config import AuxConfig, check_attention_choice, serving_params
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if str(cfg.model_path).lower() in ("none", "dummy"):
        return
    hf_config = model_config_of(server_args).hf_config
    full = cfg.attention_backend
    names = {full, cfg.prefill_attention_backend or full, cfg.decode_attention_backend or full}
    dash = BACKEND_NAME in names
    raw = getattr(server_args, "_raw_input", {}).get("attention_backend")
    chosen = f"--attention-backend {full}" if raw else f"the attention backend SGLang chose ({full})"
    if check_attention_choice(hf_config, dash, chosen, DASH_FLAG):
        logger.warning("DASH_ALLOW_DENSE=1: serving the DASH checkpoint %s with dense attention (%s), which is "
                       "not the model it was trained as; for comparisons only", cfg.model_path, full)
    if not dash:
        return
    if names != {BACKEND_NAME}:
        raise reject(f"a hybrid prefill/decode backend pair {sorted(n for n in names if n)}",
                      "DASH must see every K/V write to keep its block summaries; use --attention-backend dash "
                      "for both")
    params = serving_params(hf_config)
    aux = AuxConfig.from_config(hf_config)
    check_page_size(cfg.page_size or 1, params.block_size, "--page-size")
    if cfg.speculative_algorithm is not None:
        raise reject(f"speculative decoding ({cfg.speculative_algorithm})",
                      "TARGET_VERIFY / draft batches are not implemented")
    if aux.page_mode:
        problems = page_mode_problems(cfg.chunked_prefill_size, model_config_of(server_args).context_len,
                                      bool(cfg.enable_mixed_chunk))
        if problems:
            raise reject(*problems[0])
