"""vLLM's OpenAI server started with the README's CPU command (``python -m adapters.vllm.serve``), as a user
pastes it (only the port differs).

One server serves every check of this module: the README's completion and streamed requests; the start-up
line (and no "Cannot use AttentionBackendEnum.CUSTOM backend on CPU"); tokens equal to the reference model;
32 concurrent requests of mixed lengths with shared prefixes, whose tokens equal the same requests run one at
a time; malformed requests answered with 400, after which the server still answers. Start-up errors: the
entry point refuses a missing ``--block-size``, a dense backend for a DASH checkpoint and ``CUSTOM`` for a
model that is not DASH before vLLM starts; vLLM's own configuration (``LLM(...)``, ``vllm serve``) runs the
same checks through the plugin's config hook.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("vllm")

from tests.engines import _http_serving as http
from tests.engines import _vllm_support as support
from tests.tiny_dash_llama import reference_generate

pytestmark = pytest.mark.engine_vllm
_budget = support.budget("server", 300)
LOGPROB_TOL = 2e-4  # fp32 engine against the float64 reference model, as in test_vllm_engine.py


workdir, commands, checkpoint, server = http.server_fixtures("vllm", support.check_free_disk)


def _complete(port: int, ids: list, new_tokens: int, logprobs: bool = False) -> dict:
    body = {"model": "tiny-dash", "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if logprobs:
        body["logprobs"] = 1
    status, out = http.request(port, "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]


def test_readme_completion_and_stream(server, commands):
    out, events = http.readme_requests(server.port, commands["requests"])
    text = out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 8 and isinstance(text, str) and text
    assert "".join(e["choices"][0]["text"] for e in events) == text  # greedy: the stream carries the same text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_start_up_line_names_the_path_and_the_settings(server):
    log = server.log()
    lines = [ln for ln in log.splitlines() if "DASH attention on:" in ln]
    assert len(lines) == 1, log[-4000:]  # one worker
    assert "PyTorch paged path (cpu, float32: for correctness and tests" in lines[0]
    assert "block size 16, page size 16, topk 2, local 16, router kv_head, scaling_factor 4" in lines[0]
    assert "Cannot use AttentionBackendEnum.CUSTOM backend on CPU" not in log


def test_tokens_equal_the_reference_model(server, checkpoint):
    ids = http.load_prompts(1, seed=11)[0][0]
    out = _complete(server.port, ids, 4, logprobs=True)
    new, lps = reference_generate(checkpoint, ids, 4)
    assert out["token_ids"] == new
    got = out["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, lps)) < LOGPROB_TOL


def _tokens(server):
    return lambda ids, n: _complete(server.port, ids, n)["token_ids"]


def test_32_concurrent_requests_equal_one_at_a_time(server, checkpoint):
    # a flip needs a near tie: two log-probabilities each within LOGPROB_TOL of the reference's
    http.check_concurrent_equals_serial(_tokens(server), checkpoint, 2 * LOGPROB_TOL)


def test_malformed_requests_get_400_and_the_server_keeps_serving(server):
    out_of_vocabulary = ("a token id outside the vocabulary",
                         json.dumps({"model": "tiny-dash", "prompt": [5, 6, 7000], "max_tokens": 2}).encode())
    http.check_malformed_get_400(server.port, _tokens(server), http.load_prompts(1, seed=3)[0][0],
                                 http.MALFORMED + [out_of_vocabulary])


def _refused(cmd: http.Command, argv: list, workdir: str, name: str, env: dict | None = None) -> str:
    """Run a server command that must stop before vLLM starts; returns its output."""
    srv = http.Server(http.Command(cmd.line, cmd.env, argv), workdir, os.path.join(workdir, f"{name}.log"), env)
    rc, _ = srv.wait_exit()
    log = srv.log()
    assert rc == 2, log[-3000:]
    assert "adapters.vllm.serve: error:" in log and "Starting to load model" not in log, log[-3000:]
    return log


def test_the_entry_point_refuses_a_missing_block_size(commands, checkpoint, workdir):
    cmd = commands["vllm"]
    argv = list(cmd.argv)
    del argv[argv.index("--block-size"): argv.index("--block-size") + 2]
    log = _refused(cmd, argv, workdir, "no_block_size")
    assert "serving a DASH model in vLLM needs --block-size 16" in log


def test_the_entry_point_refuses_dense_attention_for_a_dash_checkpoint(commands, checkpoint, workdir):
    cmd = commands["vllm"]
    log = _refused(cmd, cmd.argv + ["--attention-backend", "CPU_ATTN"], workdir, "dense")
    assert ("--attention-backend CPU_ATTN would serve it with dense attention" in log
            and "add --attention-backend CUSTOM" in log and "DASH_ALLOW_DENSE=1" in log)


def test_the_entry_point_refuses_dash_for_a_model_that_is_not_dash(commands, checkpoint, workdir):
    plain = os.path.join(workdir, "plain")
    shutil.copytree(checkpoint, plain, dirs_exist_ok=True)
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    cmd = commands["vllm"]
    argv = list(cmd.argv)
    argv[argv.index("--model") + 1] = "plain"
    log = _refused(cmd, argv + ["--attention-backend", "CUSTOM"], workdir, "plain")
    assert ("--attention-backend CUSTOM selects DASH attention, but the model is not a DASH model "
            "(architectures ['LlamaForCausalLM'])") in log


def test_vllms_own_configuration_runs_the_same_checks(checkpoint, monkeypatch):
    """The plugin's config hook: ``LLM(...)`` and ``vllm serve`` build this configuration before any engine
    process starts."""
    monkeypatch.delenv("DASH_ALLOW_DENSE", raising=False)
    with pytest.raises(ValueError, match=r"serving a DASH model in vLLM needs --block-size 16"):
        support.engine_config(checkpoint, block_size=None)
    with pytest.raises(ValueError, match=r"--block-size is 32, DASH block size \(chunk_size\) is 16"):
        support.engine_config(checkpoint, block_size=32)
    with pytest.raises(ValueError, match=r"--attention-backend CPU_ATTN would serve it with dense attention"):
        support.engine_config(checkpoint, attention_backend="CPU_ATTN", block_size=32)
    monkeypatch.setenv("DASH_ALLOW_DENSE", "1")
    support.engine_config(checkpoint, attention_backend="CPU_ATTN", block_size=32)  # the dense comparison
