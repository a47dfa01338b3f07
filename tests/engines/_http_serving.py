"""The README's CPU serving commands, run as written, and the HTTP checks both engines' server tests share.

The README's serving section holds one ``bash`` block after the marker ``<!-- ci: cpu-serving -->``: the
tiny checkpoint's command, one server command per engine and two ``curl`` requests. ``readme_commands``
reads that block, so the tests start exactly what a user pastes; the only change is ``--port``, which gets
a free port, and ``python``, which becomes this interpreter. ``Server`` starts a command in its own process
group in a scratch directory (where the checkpoint's relative path points) and stops it by that group.

Checks on a running server: the README's completion and streamed requests (``readme_requests``); 32
concurrent requests of mixed lengths with shared prefixes, whose tokens must equal the same requests run
one at a time (``load_prompts``, ``run_concurrently``); malformed requests answered with 400 while the
server keeps serving (``MALFORMED``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import torch

from tests.tiny_dash_llama import greedy_shortfall

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
MARKER = "<!-- ci: cpu-serving -->"
START_TIMEOUT_S = 400


@dataclass
class Command:
    """One line of the README block: environment assignments, then argv (``python`` as this interpreter)."""

    line: str
    env: dict = field(default_factory=dict)
    argv: list = field(default_factory=list)

    def with_port(self, port: int) -> list:
        """argv with the value of ``--port`` replaced."""
        argv = list(self.argv)
        i = argv.index("--port")
        argv[i + 1] = str(port)
        return argv


def readme_block(path: str = README) -> list:
    """The lines (comments and blanks dropped, ``\\`` continuations joined) of the block after ``MARKER``."""
    text = open(path).read()
    at = text.index(MARKER)
    m = re.search(r"```bash\n(.*?)```", text[at:], re.S)
    assert m, f"no ```bash block after {MARKER} in {path}"
    joined = m.group(1).replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def parse(line: str) -> Command:
    """A README line as a ``Command``: leading ``NAME=value`` words go to the environment."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words and words[0] == "python":
        words[0] = sys.executable
    return Command(line, env, words)


def readme_commands() -> dict:
    """``{"checkpoint", "sglang", "vllm": Command, "requests": [Command, ...]}`` from the README block."""
    out = {"requests": []}
    for line in readme_block():
        cmd = parse(line)
        if "dash_core.tiny_checkpoint" in cmd.argv:
            out["checkpoint"] = cmd
        elif "sglang.launch_server" in cmd.argv:
            out["sglang"] = cmd
        elif "adapters.vllm.serve" in cmd.argv:
            out["vllm"] = cmd
        elif cmd.argv[:1] == ["curl"]:
            out["requests"].append(cmd)
        else:
            raise AssertionError(f"README CPU serving block: a line the tests do not know how to run: {line}")
    missing = {"checkpoint", "sglang", "vllm"} - set(out)
    assert not missing and len(out["requests"]) == 2, f"README CPU serving block lacks {missing or 'two curls'}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(extra: dict) -> dict:
    """This environment plus ``extra``, with this checkout first on ``PYTHONPATH`` (the engines' processes
    must import this tree's adapters, whatever copy the environment installed)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return env


def make_checkpoint(cmd: Command, cwd: str) -> str:
    """Run the README's checkpoint command in ``cwd``; returns the checkpoint's absolute path."""
    r = subprocess.run(cmd.argv, cwd=cwd, env=subprocess_env(cmd.env), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd.line}\n{r.stdout}\n{r.stderr}"
    return os.path.join(cwd, cmd.argv[cmd.argv.index("dash_core.tiny_checkpoint") + 1])


class Server:
    """A README server command on a free port, in its own process group, logging to ``log_path``."""

    def __init__(self, cmd: Command, cwd: str, log_path: str, env: dict | None = None):
        self.port = free_port()
        self.log_path = log_path
        self.started = time.monotonic()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd.with_port(self.port), cwd=cwd,
                                         env=subprocess_env({**cmd.env, **(env or {})}), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, tail: int = 0) -> str:
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        return text[-tail:] if tail else text

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answers 200; fails with the log's tail if the server exits or hangs."""
        deadline = self.started + timeout
        while True:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log(6000)}"
            assert time.monotonic() < deadline, f"server not healthy after {timeout} s:\n{self.log(6000)}"
            try:
                if request(self.port, "/health", timeout=5)[0] == 200:
                    return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> tuple[int, float]:
        """(exit status, seconds) of a start that must fail."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"server did not stop within {timeout} s:\n{self.log(6000)}")
        return rc, time.monotonic() - self.started

    def stop(self) -> None:
        """TERM, then KILL, the server's process group (the one this object created)."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def serving(cmd: Command, workdir: str):
    """A server fixture's body: ``cmd``'s server started in ``workdir`` (its checkpoint written there first), the
    healthy ``Server`` yielded, then stopped."""
    srv = Server(cmd, workdir, os.path.join(workdir, "server.log"))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def server_fixtures(engine: str, check_free_disk) -> tuple:
    """The module-scoped fixtures of an engine's server tests, to bind by name in the test module:
    ``workdir, commands, checkpoint, server = server_fixtures("sglang", check_free_disk)``. ``workdir``: a scratch
    directory (``check_free_disk(path)`` first); ``commands``: the README's; ``checkpoint``: written there by the
    README's command; ``server``: the README's ``engine`` command serving it (``serving``)."""
    import pytest  # here, not at the top: the throughput tool (``main``) runs without pytest

    @pytest.fixture(scope="module")
    def workdir(tmp_path_factory):
        path = str(tmp_path_factory.mktemp(f"{engine}_server"))
        check_free_disk(path)
        return path

    @pytest.fixture(scope="module")
    def commands():
        return readme_commands()

    @pytest.fixture(scope="module")
    def checkpoint(commands, workdir):
        return make_checkpoint(commands["checkpoint"], workdir)

    @pytest.fixture(scope="module")
    def server(commands, checkpoint, workdir):
        yield from serving(commands[engine], workdir)

    return workdir, commands, checkpoint, server


def request(port: int, path: str, body=None, timeout: float = 120, raw: bytes | None = None):
    """``(status, parsed JSON or None)`` of a GET (no body) or POST to the server; HTTP errors are returned."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
            return r.status, (json.loads(text) if text.strip() else None)
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text.decode(errors="replace")


def stream(port: int, path: str, body: dict, timeout: float = 120) -> list:
    """The JSON events of a server-sent-event stream, until ``data: [DONE]``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return events
            events.append(json.loads(data))
    raise AssertionError(f"stream ended without [DONE] after {len(events)} events")


def curl_request(cmd: Command) -> tuple[str, dict]:
    """(path, JSON body) of a README ``curl`` line."""
    url = next(w for w in cmd.argv if w.startswith("http"))
    body = json.loads(cmd.argv[cmd.argv.index("-d") + 1])
    return "/" + url.split("/", 3)[3], body


def readme_requests(port: int, requests: list) -> tuple[dict, list]:
    """Send the README's completion and streamed requests; returns (completion response, stream events)."""
    (path, body), (spath, sbody) = (curl_request(c) for c in requests)
    assert not body.get("stream") and sbody.get("stream") is True, "README: one curl completes, the next streams"
    status, out = request(port, path, body)
    assert status == 200, out
    return out, stream(port, spath, sbody)


def load_prompts(n: int = 32, seed: int = 0) -> list:
    """``n`` (token ids, new tokens) of mixed lengths: three shared prefixes (40, 96 and 150 tokens, 2 to 9
    blocks of 16) each continued by suffixes of 1-60 tokens, some prompts repeated whole; 3-10 new tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: (torch.randint(0, 95, (k,), generator=g) + 3).tolist()
    prefixes = [ids(40), ids(96), ids(150)]
    out = []
    for i in range(n):
        base = prefixes[i % 3]
        suffix = [] if i % 8 == 7 else ids(int(torch.randint(1, 61, (1,), generator=g)))
        out.append((base + suffix, int(torch.randint(3, 11, (1,), generator=g))))
    return out


def check_concurrent_equals_serial(tokens, checkpoint: str, tol: float) -> None:
    """``load_prompts``' requests served together give the tokens they get one at a time (``tokens(ids, n)``: a
    request's greedy tokens), and those are the reference model's greedy tokens: each within ``tol`` of the best
    log-probability given the tokens before it (a near tie may go either way; a wrong history, such as a prefix
    cache hit on the wrong pages, moves the choice by far more)."""
    prompts = load_prompts()
    one_by_one = [tokens(ids, n) for ids, n in prompts]
    together = run_concurrently(tokens, prompts)
    assert [len(t) for t in one_by_one] == [n for _, n in prompts]
    assert together == one_by_one
    shortfall = [greedy_shortfall(checkpoint, ids, new) for (ids, _), new in zip(prompts, one_by_one)]
    assert max(shortfall) < tol, shortfall


def check_malformed_get_400(port: int, tokens, ids: list, malformed: list) -> None:
    """Each of ``malformed`` (``(what, raw body)``) posted to the completions endpoint gets a 400, after which the
    server is healthy and ``tokens(ids, 4)`` is what it was before."""
    before = tokens(ids, 4)
    for what, raw in malformed:
        status, out = request(port, "/v1/completions", raw=raw)
        assert status == 400, f"{what}: {status} {out}"
    assert request(port, "/health")[0] == 200
    assert tokens(ids, 4) == before


def run_concurrently(fn, prompts: list, workers: int = 32) -> list:
    """``fn(ids, new_tokens)`` for every prompt at once (``workers`` threads), results in prompt order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: fn(*p), prompts))


# Malformed requests to /v1/completions, each answered with 400 by both engines: (what, raw body).
MALFORMED = [
    ("a body that is not JSON", b'{"prompt": [5, 6'),
    ("max_tokens below 1", json.dumps({"model": "tiny-dash", "prompt": [5, 6, 7], "max_tokens": -3}).encode()),
    ("a prompt longer than the context", json.dumps({"model": "tiny-dash", "prompt": [5] * 2100,
                                                     "max_tokens": 2}).encode()),
]


def throughput(port: int, requests: int, prompt_len: int, new_tokens: int, model: str, seed: int = 0) -> dict:
    """``requests`` concurrent completions of distinct random prompts of ``prompt_len`` tokens and
    ``new_tokens`` new tokens each (after one warm-up request); wall time and tokens per second."""
    g = torch.Generator().manual_seed(seed)
    prompts = [(torch.randint(0, 95, (prompt_len,), generator=g) + 3).tolist() for _ in range(requests + 1)]

    def one(ids):
        status, out = request(port, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": new_tokens,
                                                        "temperature": 0, "ignore_eos": True}, timeout=3600)
        assert status == 200, out
        return out["usage"]["completion_tokens"]

    one(prompts[0])
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=requests) as pool:
        generated = sum(pool.map(one, prompts[1:]))
    wall = time.monotonic() - start
    return {"wall_s": wall, "prompt_tok_s": requests * prompt_len / wall, "generated_tok_s": generated / wall,
            "total_tok_s": (requests * prompt_len + generated) / wall}


def main(argv=None) -> None:
    """``python -m tests.engines._http_serving --port 8000 [--requests 8 --prompt-len 1024 --new-tokens 16]``:
    the throughput of a running server (either engine's OpenAI endpoint), as the README's CPU figure."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.engines._http_serving", description=main.__doc__)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="tiny-dash")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    r = throughput(a.port, a.requests, a.prompt_len, a.new_tokens, a.model)
    print(f"{a.requests} concurrent requests x ({a.prompt_len} prompt + {a.new_tokens} new tokens): "
          f"{r['wall_s']:.1f} s, "
          f"{r['total_tok_s']:.0f} tokens/s ({r['prompt_tok_s']:.0f} prompt, {r['generated_tok_s']:.1f} generated)")


if __name__ == "__main__":
    main()
