"""The SGLang HTTP server started with the README's CPU command, as a user pastes it (only the port differs).

One server serves every check of this module: the README's completion and streamed requests; the start-up
line; tokens equal to the reference model; 32 concurrent requests of mixed lengths with shared prefixes,
whose tokens equal the same requests run one at a time; malformed requests answered with 400, after which
the server still answers. Start-up errors: the serving rule (through SGLang's own argument resolution, in
this process) and a ``--page-size`` that does not fit, which stops the real server before the weights load.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from tests.engines import _http_serving as http
from tests.engines._sglang_support import budget, check_free_disk, environment, prompt
from tests.tiny_dash_llama import reference_generate

_budget = budget("server", 420)
LOGPROB_TOL = 2e-3  # as in test_sglang_engine.py


workdir, commands, checkpoint, server = http.server_fixtures("sglang", check_free_disk)


def _generate(port: int, ids: list, new_tokens: int, logprobs: bool = False) -> dict:
    status, out = http.request(port, "/generate", {
        "input_ids": ids, "return_logprob": logprobs,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
    assert status == 200, out
    return out


def test_readme_completion_and_stream(server, commands):
    out, events = http.readme_requests(server.port, commands["requests"])
    text = out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 8 and isinstance(text, str) and text
    assert "".join(e["choices"][0]["text"] for e in events) == text  # greedy: the stream carries the same text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_start_up_line_names_the_path_and_the_settings(server):
    log = server.log()
    lines = [ln for ln in log.splitlines() if "DASH attention on:" in ln]
    assert len(lines) == 1, log[-4000:]
    assert "PyTorch paged path (cpu, float32: for correctness and tests" in lines[0]
    assert "block size 16, page size 16, topk 2, local 16, router kv_head, scaling_factor 4" in lines[0]
    assert "attention_backend='TRITON'" not in log and "Triton kernels" not in lines[0]


def test_tokens_equal_the_reference_model(server, checkpoint):
    ids = prompt(70, seed=11)
    out = _generate(server.port, ids, 4, logprobs=True)
    new, lps = reference_generate(checkpoint, ids, 4)
    assert out["output_ids"] == new
    got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, lps)) < LOGPROB_TOL


def _tokens(server):
    return lambda ids, n: _generate(server.port, ids, n)["output_ids"]


def test_32_concurrent_requests_equal_one_at_a_time(server, checkpoint):
    # a flip needs a near tie: two log-probabilities each within LOGPROB_TOL of the reference's
    http.check_concurrent_equals_serial(_tokens(server), checkpoint, 2 * LOGPROB_TOL)


def test_malformed_requests_get_400_and_the_server_keeps_serving(server):
    http.check_malformed_get_400(server.port, _tokens(server), prompt(40, seed=3), http.MALFORMED)


def _resolve(*argv: str):
    """SGLang's own argument resolution in this process, where the plugin's start-up checks run."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = prepare_server_args(list(argv))
    args.resolve_once()
    return args


def test_a_dash_checkpoint_needs_the_dash_backend(checkpoint):
    cpu = ("--device", "cpu", "--dtype", "float32", "--page-size", "16")
    with pytest.raises(ValueError, match=r"DASH checkpoint .* \(torch_native\) would serve it with dense attention.*"
                                         r"add --attention-backend dash.*DASH_ALLOW_DENSE=1"):
        _resolve("--model-path", checkpoint, *cpu)
    with environment(DASH_ALLOW_DENSE="1"):
        _resolve("--model-path", checkpoint, *cpu)  # the comparison the override exists for


def test_dash_needs_a_dash_checkpoint(checkpoint, workdir):
    import json
    import shutil

    plain = os.path.join(workdir, "plain")
    shutil.copytree(checkpoint, plain, dirs_exist_ok=True)
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"--attention-backend dash selects DASH attention, but the model is not a "
                                         r"DASH model \(architectures \['LlamaForCausalLM'\]\)"):
        _resolve("--model-path", plain, "--device", "cpu", "--attention-backend", "dash", "--page-size", "16")


def test_a_page_size_that_does_not_fit_stops_the_server_before_the_weights_load(commands, checkpoint, workdir):
    cmd = commands["sglang"]
    argv = list(cmd.argv)
    argv[argv.index("--page-size") + 1] = "8"
    srv = http.Server(http.Command(cmd.line, cmd.env, argv), workdir, os.path.join(workdir, "bad_page.log"))
    rc, _ = srv.wait_exit()
    log = srv.log()
    assert rc != 0
    assert "page size must be a multiple of the DASH block size: --page-size is 8" in log, log[-3000:]
    assert "Load weight" not in log  # refused while the arguments resolve, before the scheduler loads anything
