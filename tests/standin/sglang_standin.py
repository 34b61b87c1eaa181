"""A stand-in for ``python -m sglang.launch_server``: same arguments, same HTTP endpoints.

It serves /health, /get_server_info, /v1/models and /v1/completions (echo + logprobs for
log-likelihoods, greedy generation with stop strings), and like SGLang it runs a second process
(its "scheduler") in its process group. ``--standin-mode`` plants the failures the tests need:

  model            real log-probabilities from the checkpoint (quantkit's loader, CPU)
  hash             fake but deterministic log-probabilities; no model is loaded
  never-healthy    /health answers 503 forever
  exit-at-start    prints an error and exits 3 before listening
  crash-after=N    answers N completion requests, then dies (exit 9)
  malformed        /v1/completions answers a body that is not JSON
  filler           the real model's answers, each followed by unrelated text worth half its tokens (x1.5)
  loop             the real model's answers, except that one prompt in two loops to the token limit
  unquantized      real log-probabilities of the source the checkpoint's manifest names, under the checkpoint's name
                   (an engine that loaded a quantized checkpoint unquantized)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PLANTED = ("filler", "loop")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="sglang-standin")
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--ep-size", "--expert-parallel-size", "--ep", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"])
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--random-seed", type=int)
    # the mode may come from the environment, so that runs meant as one setup share one server command
    p.add_argument("--standin-mode", default=os.environ.get("STANDIN_MODE", "model"))
    p.add_argument("--standin-pids", help="Write the pids of this server and its scheduler here.")
    p.add_argument("--standin-answers", help="A JSON-lines file of the real model's greedy answers: read at start, "
                                             "each new one appended (servers started one after another share them).")
    return p.parse_args(argv)


class Scorer:
    """Log-probabilities and greedy text, from the real model or from a hash."""

    def __init__(self, model_path: str, real: bool, answers_file: str | None = None):
        self.real = real
        self.answers_file = answers_file
        self.answers: dict[str, str] = {}
        if answers_file and os.path.isfile(answers_file):
            for line in open(answers_file):
                record = json.loads(line)
                self.answers[record["key"]] = record["text"]
        if real:
            import torch
            from transformers import AutoTokenizer

            from quantkit.checkpoint.reader import open_checkpoint
            from quantkit.compute_dtype import compute_dtype
            from quantkit.modeling import load_model, model_dtype

            self.torch = torch
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            # the dtype the hf engine computes in on this CPU (auto), so the two engines' answers can be compared
            dtype = compute_dtype("auto", "cpu", model_dtype(open_checkpoint(model_path).config))
            self.model = load_model(model_path, dtype).eval()
        self.lock = threading.Lock()

    def echo_logprobs(self, tokens: list[int]) -> tuple[list, list]:
        """Per position j>0: log p(token j | tokens before), and the top-1 alternative."""
        if not self.real:
            lps = [None] + [-((hashlib.sha256(bytes(str(tokens[: j + 1]), "ascii")).digest()[0] % 50) / 10)
                            for j in range(1, len(tokens))]
            return lps, [None] + [{str(t): lp} for t, lp in zip(tokens[1:], lps[1:])]
        torch = self.torch
        with self.lock, torch.no_grad():
            logits = self.model(torch.tensor([tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        lps, tops = [None], [None]
        for j in range(1, len(tokens)):
            lp = float(logp[j - 1, tokens[j]])
            best = int(logp[j - 1].argmax())
            lps.append(lp)
            tops.append({self.tokenizer.decode([best]): float(logp[j - 1, best]), self.tokenizer.decode([tokens[j]]): lp})
        return lps, tops

    def generate(self, tokens: list[int], max_tokens: int, stop: list[str]) -> str:
        if not self.real:
            return f" The answer is {int(hashlib.sha256(str(tokens).encode()).hexdigest(), 16) % 100}."
        key = hashlib.sha256(json.dumps([tokens, max_tokens, stop]).encode()).hexdigest()
        with self.lock:
            if key not in self.answers:
                self.answers[key] = self._generate(tokens, max_tokens, stop)
                if self.answers_file:
                    with open(self.answers_file, "a") as f:
                        f.write(json.dumps({"key": key, "text": self.answers[key]}) + "\n")
            return self.answers[key]

    def _generate(self, tokens: list[int], max_tokens: int, stop: list[str]) -> str:
        torch = self.torch
        with torch.no_grad():  # greedy, with the KV cache, stopping at a stop string or EOS
            out = self.model.generate(torch.tensor([tokens]), max_new_tokens=max_tokens, do_sample=False,
                                      stop_strings=stop or None, tokenizer=self.tokenizer,
                                      pad_token_id=self.tokenizer.eos_token_id)
        text = self.tokenizer.decode(out[0, len(tokens):], skip_special_tokens=True)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        return text

    def planted(self, mode: str, tokens: list[int], text: str, max_tokens: int) -> str:
        """A planted misbehaviour on top of the real answer ``text``."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if mode == "filler":
            extra = self.tokenizer(FILLER, add_special_tokens=False)["input_ids"][: max(1, round(len(ids) / 2))]
            return self.tokenizer.decode(ids[: max_tokens - len(extra)] + extra)
        if mode == "loop" and int(hashlib.sha256(str(tokens).encode()).hexdigest(), 16) % 2 == 0:
            step = self.tokenizer(" Let me check that again.", add_special_tokens=False)["input_ids"]
            return self.tokenizer.decode((ids[:8] + step * max_tokens)[:max_tokens])
        return text


# Unrelated text, no stop strings in it and no sentence repeated: length without a loop.
FILLER = (" As a side note, the history of arithmetic stretches back thousands of years, from tally marks on bone to"
          " clay tablets in Mesopotamia, abacus beads in markets across Asia, and the positional notation that"
          " travelled from India through Baghdad into medieval Europe, where merchants slowly adopted it for"
          " bookkeeping, navigation, astronomy, surveying, engineering and, eventually, the design of machines that"
          " compute faster than any clerk could write the figures down on paper by candlelight.")


def serve(args) -> None:
    mode, _, count = args.standin_mode.partition("=")
    if mode == "exit-at-start":
        print("RuntimeError: stand-in told to fail at start", flush=True)
        sys.exit(3)
    scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    if args.standin_pids:
        with open(args.standin_pids, "w") as f:
            f.write(f"{os.getpid()} {scheduler.pid}\n")

    def shutdown(signum, frame):
        scheduler.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    weights = args.model_path
    if mode == "unquantized":  # the source the manifest names, as an engine that dropped the quantization serves it
        with open(os.path.join(args.model_path, "quantkit-manifest.json")) as f:
            weights = json.load(f)["source_path"]
    scorer = Scorer(weights, real=(mode in ("model", "unquantized") or mode in PLANTED),
                    answers_file=args.standin_answers)
    served = {"n": 0}
    name = os.path.basename(os.path.normpath(args.model_path))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            print(fmt % a, flush=True)

        def _send(self, code: int, body: bytes, kind: str = "application/json"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(503 if mode == "never-healthy" else 200, b"")
            elif self.path == "/get_server_info":
                self._send(200, json.dumps({"version": "0.0-standin", "tp_size": args.tp_size,
                                            "kv_cache_dtype": args.kv_cache_dtype}).encode())
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": name, "object": "model"}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._send(404, b"{}")
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            served["n"] += 1
            if mode == "crash-after" and served["n"] > int(count):
                print("Fatal: stand-in scheduler died", flush=True)
                scheduler.kill()
                os._exit(9)
            if mode == "malformed":
                return self._send(200, b"<html>upstream error</html>")
            prompts = request["prompt"]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            choices = []
            for i, prompt in enumerate(prompts):
                tokens = prompt if isinstance(prompt, list) else scorer.tokenizer(prompt)["input_ids"]
                if request.get("echo"):
                    lps, tops = scorer.echo_logprobs(tokens + [tokens[-1]])  # + one "generated" token
                    choice = {"text": "", "logprobs": {"token_logprobs": lps, "top_logprobs": tops}}
                else:
                    stop = request.get("stop") or []
                    limit = int(request.get("max_tokens", 16))
                    text = scorer.generate(tokens, limit, [stop] if isinstance(stop, str) else stop)
                    choice = {"text": scorer.planted(mode, tokens, text, limit) if mode in PLANTED else text}
                choices.append(dict(choice, index=i, finish_reason="stop"))
            self._send(200, json.dumps({"object": "text_completion", "model": name, "choices": choices}).encode())

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"The server is fired up and ready to roll! ({args.standin_mode})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve(parse_args(sys.argv[1:]))
