"""``sgl.Engine`` with the serving-time DASH options: the attention-stage backend (issue 6).

The attention-stage backend is chosen with ``DASH_ATTENTION_BACKEND`` (read once by the backend in the
scheduler process SGLang spawns): the recorded op calls show it in ``DashParams``, and on the CPU the
result is the PyTorch path's, equal to the reference forward.
"""

from __future__ import annotations

import contextlib
import os

import pytest

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from tests.engines._sglang_support import (  # noqa: E402
    budget,
    engine,
    generate,
    output_logprobs,
    prompt,
    prompt_logprobs,
    write_tiny_checkpoint,
)
from tests.tiny_dash_llama import reference_generate, reference_logprobs  # noqa: E402

_budget = budget("aux", 240)

# As test_sglang_engine.py: a float32 engine against the float64 reference through 2 layers measures about
# 5e-5 in log-probability; 2e-3 keeps a 40x margin.
LOGPROB_TOL = 2e-3
NEW_TOKENS = 4
# Page mode prefills a prompt in one chunk (--chunked-prefill-size -1). SGLang then reserves activation memory
# for max_prefill_tokens (default 16384: more than this machine has); these prompts are far shorter.
ONE_CHUNK = dict(chunked_prefill_size=-1, max_prefill_tokens=2048)


@contextlib.contextmanager
def _env(**values):
    """Set environment variables for an engine start (SGLang's processes inherit them), restore after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def backend_engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sglang_aux") / "sparse")
    write_tiny_checkpoint(path, chunk_size=16, scaling_factor=4.0, dash_topk=2)
    record_dir = str(tmp_path_factory.mktemp("aux_batches"))
    with _env(DASH_ATTENTION_BACKEND="flashinfer", DASH_RECORD_DIR=record_dir, DASH_RECORD_MAX="8"):
        with engine(path, **ONE_CHUNK) as eng:
            eng.path, eng.record_dir = path, record_dir
            yield eng


def test_attention_backend_env_reaches_dash_params_in_the_engine(backend_engine):
    from dash_core.recorder import load_batches

    ids = prompt(70, seed=11)
    (r,) = generate(backend_engine, [ids], NEW_TOKENS)
    batches = load_batches(os.path.join(backend_engine.record_dir, "*.pt"))
    assert batches and {b["params"]["attention_backend"] for b in batches} == {"FLASHINFER"}
    assert {b["params"]["topk"] for b in batches} == {2}  # the rest of DashParams still comes from the config
    # On the CPU the library backend is not used: the PyTorch path's result, equal to the reference forward.
    lp = reference_logprobs(backend_engine.path, ids)
    assert _max_diff(prompt_logprobs(r), [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]) < LOGPROB_TOL
    new, lps = reference_generate(backend_engine.path, ids, NEW_TOKENS)
    assert r["output_ids"] == new and _max_diff(output_logprobs(r), lps) < LOGPROB_TOL
