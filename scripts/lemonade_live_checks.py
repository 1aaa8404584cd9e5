#!/usr/bin/env python3
"""Drives a lemond built with the Atlas patches (scripts/lemonade_e2e.sh runs it): starts it with a
private cache directory on a free port, registers Atlas's default model (a GGUF file) and the
chat_tiny fixture (a safetensors directory) as local models, then checks what a Lemonade user does:
plain and streamed chat, the ctx_size clamp, unload and reload, a bad request, a client that goes
away mid-stream, `lemonade config set atlas.backend=cpu`. One PASS/FAIL line per check; exit
status 1 if any failed. Standard library only.
"""

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

failures = 0


def report(name, ok, detail=""):
    global failures
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)
    failures += 0 if ok else 1


class Lemond:
    def __init__(self, binary, workdir):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = os.path.join(workdir, "lemond.log")
        self.log = open(self.log_path, "w")
        # cache_dir alone: a portable install, config.json beside the models, nothing of the user's.
        self.proc = subprocess.Popen([binary, workdir, "--port", str(self.port), "--no-broadcast"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if self.get("/api/v1/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"lemond did not answer on port {self.port} (log: {self.log_path})")

    def request(self, method, path, body=None, timeout=300):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, body, timeout=300):
        return self.request("POST", path, body, timeout)

    def log_text(self):
        self.log.flush()
        return open(self.log_path, errors="replace").read()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat(lemond, model, content, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 24}
    body.update(extra)
    return lemond.post("/api/v1/chat/completions", body)


def answer_of(status, text):
    if status != 200:
        return None
    return json.loads(text)["choices"][0]["message"]["content"]


def streamed(lemond, body):
    """The content deltas of a streamed chat, and whether it ended with [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", lemond.port, timeout=300)
    conn.request("POST", "/api/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    pieces, done = [], False
    for raw in resp:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
    conn.close()
    return resp.status, "".join(pieces), done


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lemond", required=True)
    ap.add_argument("--default-model", required=True, help="Atlas's default model, a .gguf file")
    ap.add_argument("--fixture", required=True, help="tests/fixtures/models/chat_tiny")
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="lemonade-e2e-")
    lemond = Lemond(args.lemond, workdir)
    try:
        run_checks(lemond, args)
    finally:
        lemond.stop()
    if failures:
        print(f"lemond log: {lemond.log_path}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


def run_checks(lemond, args):
    default, tiny = "user.SmolLM2-135M-Instruct-Atlas", "user.chat-tiny-Atlas"
    for name, path in [(default, args.default_model), (tiny, args.fixture)]:
        status, text = lemond.post("/api/v1/models/register",
                                   {"model_name": name, "recipe": "atlas", "checkpoint": path, "source": "local_path"})
        report(f"register {name} ({os.path.basename(path)})", status == 200, f"{status} {text}")

    # What Lemonade shows for Atlas's backends: the CPU always; rocm and cuda offered where such a
    # GPU is detected, else marked unsupported with the reason (atlas_backend=cuda then refused).
    status, text = lemond.get("/api/v1/system-info")
    info = json.loads(text) if status == 200 else {}
    backends = info.get("recipes", {}).get("atlas", {}).get("backends", {})
    cpu = backends.get("cpu", {})
    report("system-info: atlas cpu installed, at the linked library's version",
           cpu.get("state") == "installed" and cpu.get("version", "").startswith("v"), json.dumps(backends))
    for gpu in ["rocm", "cuda"]:
        b = backends.get(gpu, {})
        print(f"     system-info: atlas {gpu}: {b.get('state')} {b.get('message') or ''}".rstrip())
    unsupported = [g for g in ["rocm", "cuda"] if backends.get(g, {}).get("state") == "unsupported"]
    report("system-info: a GPU backend is offered or says why not",
           all(backends.get(g, {}).get("state") == "installed" or backends.get(g, {}).get("message") for g in ["rocm", "cuda"]),
           json.dumps(backends))

    status, text = chat(lemond, default, "What is the capital of France? Answer in one word.")
    content = answer_of(status, text)
    report("chat with the default model (loaded on first use)", content is not None and "Paris" in content,
           f"{status} {content if content is not None else text}")

    status, health = lemond.get("/api/v1/health")
    report("health names the loaded model", status == 200 and "SmolLM2" in health, health)

    body = {"model": default, "messages": [{"role": "user", "content": "Count from one to five."}],
            "temperature": 0, "max_tokens": 24, "stream": True}
    status, text, done = streamed(lemond, body)
    report("streamed chat: chunks, then [DONE]", status == 200 and done and len(text) > 0, f"{status} {text!r} done={done}")
    plain = answer_of(*chat(lemond, default, "Count from one to five."))
    report("streamed text equals the non-streamed answer", plain == text, f"{plain!r} vs {text!r}")

    if unsupported:
        status, text = lemond.post("/api/v1/load", {"model_name": tiny, "atlas_backend": unsupported[0]})
        report(f"atlas_backend={unsupported[0]} without such a GPU is refused with Lemonade's message",
               status != 200 and "error" in text, f"{status} {text}")

    # chat_tiny's max_position_embeddings is 1024, below the ctx_size Lemonade picks (4096).
    status, text = lemond.post("/api/v1/load", {"model_name": tiny, "atlas_backend": "cpu"})
    report("load the fixture with Lemonade's default ctx_size (clamped, not refused)", status == 200, f"{status} {text}")
    report("the clamp is logged as a warning", "clamped to the model's max_position_embeddings 1024" in lemond.log_text())
    status, text = chat(lemond, tiny, "hello", max_tokens=8)
    report("chat with the fixture", answer_of(status, text) is not None, f"{status} {text}")

    status, text = lemond.post("/api/v1/unload", {"model_name": tiny})
    report("unload", status == 200, f"{status} {text}")
    status, health = lemond.get("/api/v1/health")
    loaded = json.loads(health).get("all_models_loaded", []) if status == 200 else None
    report("the fixture is gone after unload", loaded is not None and all(m.get("model_name") != tiny for m in loaded), health)
    status, text = chat(lemond, tiny, "hello again", max_tokens=8)
    report("reload on the next request", answer_of(status, text) is not None, f"{status} {text}")

    status, text = chat(lemond, tiny, "hello", temperature=-1)
    report("a bad request is a 400 with an error object", status == 400 and "error" in json.loads(text or "{}"), f"{status} {text}")
    status, text = chat(lemond, tiny, "still there?", max_tokens=4)
    report("the model serves after the bad request", answer_of(status, text) is not None, f"{status} {text}")

    # A client that reads the first chunk of a long stream and hangs up.
    conn = http.client.HTTPConnection("127.0.0.1", lemond.port, timeout=60)
    conn.request("POST", "/api/v1/chat/completions", json.dumps({"model": tiny, "stream": True, "max_tokens": 900,
                 "messages": [{"role": "user", "content": "Write a very long story."}]}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    began = time.time()
    status, text = chat(lemond, tiny, "are you free?", max_tokens=4)
    report("a client gone mid-stream: the next request is served", first.startswith(b"data:") and answer_of(status, text) is not None,
           f"first line {first[:60]!r}; then {status} {text[:200]}")
    report("... without waiting for the abandoned generation", time.time() - began < 30, f"{time.time() - began:.1f} s")

    status, text = lemond.post("/internal/set", {"atlas": {"backend": "cpu"}})
    report("config set atlas.backend=cpu (POST /internal/set, as the lemonade CLI sends it)", status == 200, f"{status} {text}")
    status, text = lemond.get("/internal/config")
    report("config shows atlas.backend = cpu", status == 200 and json.loads(text).get("atlas", {}).get("backend") == "cpu", text[:300])
    status, text = lemond.post("/internal/set", {"atlas": {"backend": "no-such-device"}})
    report("config refuses an unknown atlas backend", status == 400, f"{status} {text}")


if __name__ == "__main__":
    sys.exit(main())
