"""The SGLang HTTP server with ``--attention-backend dash`` on 127.0.0.1, started and stopped by its pid.

- ``python -m sglang.launch_server ... --attention-backend dash`` answers ``/generate`` (text through
  the checkpoint's offline tokenizer, and token ids with log-probabilities equal to the reference
  forward) and reports the backend in ``/get_server_info``.
- ``--page-size 8`` with 16-token DASH blocks stops the server at start-up with docs/semantics.md's error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from tests.engines._sglang_support import MAX_TOTAL_TOKENS, budget, prompt, write_tiny_checkpoint  # noqa: E402
from tests.tiny_dash_llama import reference_generate  # noqa: E402

_budget = budget("server", 240)
START_TIMEOUT_S = 300
LOGPROB_TOL = 2e-3  # as in test_sglang_engine.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model: str, port: int, log_path: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
           "--dtype", "float32", "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--attention-backend", "dash",
           "--page-size", "16", "--disable-cuda-graph", "--host", "127.0.0.1", "--port", str(port),
           "--random-seed", "0", *extra]
    with open(log_path, "w") as log:
        # A session of its own, so that stopping it reaches the scheduler and detokenizer it spawns.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """TERM, then KILL, the server's process group (the one this test created)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def _http(port: int, path: str, body: dict | None = None, timeout: float = 60):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sglang_server") / "sparse")
    write_tiny_checkpoint(path, chunk_size=16, scaling_factor=4.0, dash_topk=2)
    return path


def test_http_server_generates_with_dash(checkpoint, tmp_path):
    port, log = _free_port(), str(tmp_path / "server.log")
    proc = _launch(checkpoint, port, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"server not healthy after {START_TIMEOUT_S} s:\n{_tail(log)}"
            try:
                if _http(port, "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)

        status, info = _http(port, "/get_server_info")
        assert status == 200 and info["attention_backend"] == "dash"

        status, out = _http(port, "/generate", {"text": "DASH routes each query to a few blocks.",
                                                "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert status == 200 and isinstance(out["text"], str) and out["meta_info"]["completion_tokens"] == 4

        ids = prompt(70, seed=11)
        status, out = _http(port, "/generate", {"input_ids": ids, "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert status == 200
        new, lps = reference_generate(checkpoint, ids, 4)
        assert out["output_ids"] == new
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, lps)) < LOGPROB_TOL
    finally:
        _stop(proc)
    assert proc.poll() is not None


def test_page_size_not_multiple_of_block_stops_startup(checkpoint, tmp_path):
    port, log = _free_port(), str(tmp_path / "bad_page.log")
    proc = _launch(checkpoint, port, log, "--page-size", "8")
    try:
        proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server with --page-size 8 did not stop within {START_TIMEOUT_S} s:\n{_tail(log)}")
    finally:
        _stop(proc)
    text = _tail(log, 20000)
    assert proc.returncode != 0
    assert "page size must be a multiple of the DASH block size" in text and "--page-size is 8" in text, text[-3000:]
