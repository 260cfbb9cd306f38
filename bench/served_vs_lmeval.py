"""Evaluation speed against a server: quantlab's engine=served vs lm-eval's local-completions model, one server.

One llama-cpp-python server (started here, stopped at the end) serves the default model's Q8_0 GGUF with the model's
own tokenizer. Both clients score the same windows of the default evaluation text through its /v1/completions:
- quantlab: quantlab.engines.served.ServedEngine.forward over the windows the default run builds (the data stage with
  eval.prefix_token=bos: BOS + seq_len - 1 text tokens), engine.concurrency requests in flight. Per window it sends
  the text, checks the server's tokenization (/extras/tokenize) and reads back every position's log-prob and top k;
  position 0 (after BOS alone) comes from one request for the whole distribution, once per engine.
- lm-eval: LocalCompletionsAPI.loglikelihood_rolling (lm-eval's Python API, tokenizer_backend huggingface with the
  same tokenizer files), one document per window: the window's decoded text, num_concurrent the same. It runs in its
  own virtualenv (--lmeval-python; lm-eval 0.4.13 has no torch dependency for this model) as a child process, and
  only the loglikelihood_rolling call is timed.
Windows whose decoded text does not encode back to the same tokens are left out of both sides.

What each side scores, on the same server: a document shorter than lm-eval's max_length is one rolling window of its
prefix token (BOS) and the document, the window quantlab sends; lm-eval sums the echoed log-probs after its context
token (token_logprobs[1:-1]), and llama-cpp-python's echo gives no log-prob for the first text token (position 0), so
lm-eval's sum leaves that token out where quantlab scores it (from the distribution after BOS). The NLL sums are
compared over the tokens both score (positions 1..), and quantlab's own sum is printed with position 0 as well.

    python bench/served_vs_lmeval.py [--windows 8] [--seq 128] [--lmeval-python /tmp/lmeval_venv/bin/python]
        [--gguf Q8_0.gguf] [--threads 1] [--concurrency 2] [--repeat 2] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lmeval-python", default="/tmp/lmeval_venv/bin/python")
    ap.add_argument("--gguf", default=None, help="the Q8_0 GGUF (default: written here from the embedded model)")
    ap.add_argument("--threads", type=int, default=1, help="the server's --n_threads")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight, both clients")
    ap.add_argument("--k", type=int, default=20, help="quantlab's engine.top_logprobs")
    ap.add_argument("--repeat", type=int, default=2, help="alternating runs of each client; the best is compared")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the lm-eval side, in its own virtualenv
    return ap.parse_args()


def lmeval_worker(spec_path: str) -> None:
    """The lm-eval side (run by --lmeval-python): loglikelihood_rolling of the documents against the server."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    spec = json.loads(Path(spec_path).read_text())
    lm = LocalCompletionsAPI(base_url=spec["url"] + "/v1/completions", model=spec["model"],
                             tokenizer_backend="huggingface", tokenizer=spec["tokenizer"],
                             tokenized_requests=spec["tokenized_requests"], num_concurrent=spec["concurrency"],
                             max_length=spec["max_length"], max_retries=1)
    encoded = [lm.tok_encode(t) for t in spec["texts"]]
    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
                for i, t in enumerate(spec["texts"])]
    start, cpu = time.time(), time.process_time()
    ll = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    out = {"seconds": time.time() - start, "cpu_seconds": time.process_time() - cpu, "loglikelihood": ll,
           "encoded": encoded, "prefix_token_id": lm.prefix_token_id, "max_length": lm.max_length}
    Path(spec["out"]).write_text(json.dumps(out))


def _windows(args, tmp: Path):
    """The default run's evaluation windows (data stage, eval.prefix_token=bos) and the model's tokenizer."""
    from _converted import seed_converted_model

    from quantlab import api
    from quantlab.graph import Executor, steps_for
    from quantlab.models import load_tokenizer
    from quantlab.pipeline import context

    seed_converted_model(tmp / "cache")
    cfg = api.config(["+precision=int8_sq", f"cache_dir={tmp / 'cache'}", "eval.prefix_token=bos",
                      f"eval.seq_len={args.seq}", "eval.gen_prompts=0"])
    ctx = context(cfg)
    executor = Executor(ctx, steps_for(ctx))
    ref = executor.value("prepare")
    evalset = executor.value("data:eval")
    return ref, load_tokenizer(ref), evalset.tokens[: args.windows]


def _gguf(args, tmp: Path) -> Path:
    if args.gguf:
        return Path(args.gguf)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_served import _gguf_source, requantize  # the tests' Q8_0 writer (the gguf package)

    out = tmp / "smollm2-q8_0.gguf"
    requantize(_gguf_source(), out, "Q8_0")
    return out


def _served_cfg(args, url: str):
    return SimpleNamespace(base_url=url, model="smol", dialect="llama_cpp", top_logprobs=args.k, timeout_s=600.0,
                           retries=1, concurrency=args.concurrency, api_key_env=None, revision=None, command=None,
                           serve_checkpoint=None, startup_timeout_s=300.0, identity_check=False)


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) the server process has used: the comparable figure where other jobs
    share the cores (the wall time moves with them)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _forget(url: str) -> None:
    """One unrelated prompt, so that neither client finds the other's last window in llama-cpp-python's kept KV
    state (it reuses the longest common prefix of the previous prompt)."""
    import urllib.request

    body = json.dumps({"model": "smol", "prompt": "Another text.", "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - the local server started here
        resp.read()


def _run_quantlab(args, url, tok, windows):
    from quantlab.engines.base import Limits
    from quantlab.engines.served import ServedEngine

    start, cpu = time.time(), time.process_time()
    engine = ServedEngine(_served_cfg(args, url), tok, Limits(4096, 4096, 64))  # a fresh engine: position 0 asked
    out = engine.forward(windows).sparse
    return time.time() - start, time.process_time() - cpu, out.target.double()


def _run_lmeval(args, url, ref_path, texts, tmp: Path, i: int, tokenized: bool) -> dict:
    spec = {"url": url, "model": "smol", "tokenizer": str(ref_path), "texts": texts, "concurrency": args.concurrency,
            "max_length": 2048, "tokenized_requests": tokenized, "out": str(tmp / f"lmeval{i}.json")}
    (tmp / f"spec{i}.json").write_text(json.dumps(spec))
    start = time.time()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([args.lmeval_python, str(Path(__file__).resolve()), "--worker", str(tmp / f"spec{i}.json")],
                          env={**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:], "process_seconds": time.time() - start}
    out = json.loads(Path(spec["out"]).read_text())
    out["process_seconds"] = time.time() - start
    return out


def main() -> None:
    args = _parse_args()
    if args.worker:
        lmeval_worker(args.worker)
        return
    from quantlab.engines.served import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref, tok, windows = _windows(args, tmp)
        gguf = _gguf(args, tmp)
        texts, keep = [], []
        for i, row in enumerate(windows.tolist()):
            text = tok.decode(row[1:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if tok.encode(text, add_special_tokens=False) == row[1:]:
                texts.append(text)
                keep.append(i)
        command = (f"{sys.executable} -m llama_cpp.server --model {{checkpoint}} --model_alias smol --host 127.0.0.1 "
                   f"--port {{port}} --n_ctx {max(512, args.seq + 8)} --n_threads {args.threads} --logits_all true "
                   f"--verbose false --hf_pretrained_model_name_or_path {ref.path}")
        server = ServerProcess(SimpleNamespace(command=command, serve_checkpoint=str(gguf), api_key_env=None,
                                               startup_timeout_s=300.0), tmp / "server")
        try:
            # untimed warm-up of both clients' code paths (the server loads lazily on its first request)
            _run_quantlab(args, server.url, tok, windows[:1, :8])
            probe = _run_lmeval(args, server.url, ref.path, [texts[0][:40]], tmp, 99, True)
            tokenized = "error" not in probe  # lm-eval's default sends token ids; llama-cpp-python takes text
            ours, theirs = [], []
            for i in range(args.repeat):  # alternating (and in turn first), so drift of the machine hits both
                for side in ("quantlab", "lmeval")[:: 1 if i % 2 == 0 else -1]:
                    _forget(server.url)
                    cpu0 = _server_cpu(server.proc.pid)
                    if side == "quantlab":
                        ours.append((*_run_quantlab(args, server.url, tok, windows[keep]),
                                     _server_cpu(server.proc.pid) - cpu0))
                        continue
                    theirs.append(_run_lmeval(args, server.url, ref.path, texts, tmp, i, tokenized))
                    theirs[-1]["server_cpu_seconds"] = _server_cpu(server.proc.pid) - cpu0
                    if "error" in theirs[-1]:
                        raise SystemExit(f"lm-eval failed:\n{theirs[-1]['error']}")
        finally:
            server.stop()
    _report(args, ours, theirs, keep, windows, tokenized, probe, tok)


def _report(args, ours, theirs, keep, windows, tokenized, probe, tok) -> None:
    best_ours = min(ours, key=lambda r: r[0])
    best_theirs = min(theirs, key=lambda r: r["seconds"])
    target = best_ours[2]
    ql_all = [float(-target[i].sum()) for i in range(len(keep))]
    ql_1 = [float(-target[i, 1:].sum()) for i in range(len(keep))]
    lm_nll = [-float(x) for x in best_theirs["loglikelihood"]]
    same_tokens = all(enc == windows[k, 1:].tolist() for enc, k in zip(best_theirs["encoded"], keep, strict=True))
    diffs = [abs(a - b) for a, b in zip(lm_nll, ql_1, strict=True)]
    n_pos = len(keep) * (args.seq - 1)
    result = {
        "date": "2026-12-07", "machine": "2-core AMD EPYC VM, shared", "model": "SmolLM2-135M-Instruct Q8_0 GGUF",
        "server": f"llama-cpp-python server, --n_threads {args.threads}, --logits_all, the model's tokenizer",
        "windows": len(keep), "of_windows": int(windows.shape[0]), "seq_len": args.seq, "k": args.k,
        "concurrency": args.concurrency, "lmeval_tokenized_requests": tokenized,
        "lmeval_token_ids_probe": probe.get("error", "ok")[-300:],
        "lmeval_same_tokens": same_tokens, "lmeval_prefix_token_id": best_theirs["prefix_token_id"],
        "bos_token_id": tok.bos_token_id,
        "quantlab_s": [round(r[0], 2) for r in ours], "quantlab_cpu_s": [round(r[1], 2) for r in ours],
        "lmeval_s": [round(r["seconds"], 2) for r in theirs],
        "lmeval_cpu_s": [round(r["cpu_seconds"], 2) for r in theirs],
        "lmeval_process_s": [round(r["process_seconds"], 2) for r in theirs],
        "server_cpu_s_quantlab": [round(r[3], 2) for r in ours],
        "server_cpu_s_lmeval": [round(r["server_cpu_seconds"], 2) for r in theirs],
        "server_cpu_ratio_lmeval_over_quantlab": round(min(r["server_cpu_seconds"] for r in theirs)
                                                       / min(r[3] for r in ours), 3),
        "ratio_lmeval_over_quantlab": round(best_theirs["seconds"] / best_ours[0], 3),
        "nll_positions_1_on": {"quantlab": sum(ql_1), "lmeval": sum(lm_nll),
                               "relative_difference": abs(sum(lm_nll) - sum(ql_1)) / sum(ql_1),
                               "max_abs_diff_per_window": max(diffs)},
        "nll_quantlab_with_position_0": sum(ql_all), "positions": n_pos,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=1))
    print(f"{len(keep)} windows x {args.seq} tokens, one llama-cpp-python server ({args.threads} thread(s)), "
          f"concurrency {args.concurrency}: quantlab {best_ours[0]:.1f} s, lm-eval {best_theirs['seconds']:.1f} s "
          f"(best of {args.repeat}); ratio lm-eval / quantlab {result['ratio_lmeval_over_quantlab']:.2f} (the server's "
          f"CPU seconds: {result['server_cpu_ratio_lmeval_over_quantlab']:.2f}); NLL over "
          f"positions 1..: quantlab {sum(ql_1):.4f}, lm-eval {sum(lm_nll):.4f} "
          f"(relative {result['nll_positions_1_on']['relative_difference']:.1e}); quantlab with position 0 "
          f"{sum(ql_all):.4f}; ppl quantlab {math.exp(sum(ql_all) / n_pos):.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
