"""An 8B-shaped model through quantlab on one GPU, every stage timed, against the same steps by hand (issue 39).

    python bench/at_size.py build --shape 8b --tokenizer TOK_DIR --out /tmp/m8b
    python bench/at_size.py quantlab --model /tmp/m8b --precision fp8 --data DATA_DIR --run /tmp/q_fp8 --cache C
    python bench/at_size.py by-hand --model /tmp/m8b --precision fp8 --cache C --run /tmp/q_fp8 --out /tmp/h_fp8

build: a Llama-3.1-8B-shaped model (32 layers, hidden 4096, MLP 14336, 8 KV heads, vocabulary 128,256; random
weights, bf16) with the given tokenizer. quantlab: `python -m quantlab model=local model.path=... +precision=P` on
WikiText-2 (calibration from its validation split, evaluation from its test split, articles as documents) with
audit_errors=evaluate: random weights fail the logits canary (top-1 of noise), so the audit's error is recorded and
the run goes on to its verdict (FAIL) instead of stopping there; wall time, per-stage seconds from run.json, peak
host RSS and peak GPU memory (nvidia-smi, sampled every 0.5 s). by-hand: what a user would write without quantlab
on the very tokens quantlab read (read back from its cache): load, ModelOpt quantize with its default config for the
precision over the same calibration windows, export_hf_checkpoint, and a plain perplexity loop of the reference and
of the quantized (fake-quant) model over the windows quantlab's gate used. Writes JSON lines to --out / stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

SHAPES = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
          "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=50000, rope_theta=10000.0)}
WIKI_DOCS = "^ = [^=].* = $"


class GpuPeak:
    """Peak GPU memory used (MiB) over a block, from nvidia-smi every 0.5 s (0 where there is no GPU)."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max([self.peak, *(int(x) for x in out.split() if x.isdigit())])
            except (OSError, subprocess.SubprocessError):
                return
            self._stop.wait(0.5)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=2)


def build(args) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    start = time.time()
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(args.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    return {"what": "build", "shape": args.shape, "params": params, "seconds": round(time.time() - start, 1)}


def run_quantlab(args) -> dict:
    data = Path(args.data)
    cmd = [sys.executable, "-m", "quantlab", "model=local", f"model.path={args.model}", f"+precision={args.precision}",
           f"calib.path={data / 'wiki.valid.raw'}", f"eval.path={data / 'wiki.test.raw'}",
           f"eval.doc_separator='{WIKI_DOCS}'", "audit_errors=evaluate", f"hydra.run.dir={args.run}", *args.extra]
    env = {**os.environ, "QUANTLAB_CACHE": args.cache, "HF_HUB_OFFLINE": "1"}
    start = time.time()
    with GpuPeak() as gpu:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    Path(args.run).mkdir(parents=True, exist_ok=True)
    (Path(args.run) / "bench_stdout.txt").write_text(res.stdout + "\n--- stderr\n" + res.stderr)
    record = {}
    if (Path(args.run) / "run.json").exists():
        record = json.loads((Path(args.run) / "run.json").read_text())
    metrics = {}
    if (Path(args.run) / "metrics.json").exists():
        metrics = json.loads((Path(args.run) / "metrics.json").read_text())
    audit = record.get("audit") or {}
    return {"what": "quantlab", "precision": args.precision, "exit": res.returncode, "wall_s": round(wall, 1),
            "stage_seconds": record.get("stage_seconds"), "audit_seconds": audit.get("seconds"),
            "audit_counts": audit.get("counts"), "peak_rss_mib": round(rss), "peak_gpu_mib": gpu.peak,
            "windows_used": (metrics.get("run") or {}).get("eval", {}).get("windows"),
            "plan": record.get("plan"), "last_line": res.stdout.strip().splitlines()[-1:] or res.stderr[-500:]}


def _tokens(cache: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(cache.rglob("tokens.safetensors"), key=lambda p: p.stat().st_mtime):
        tensors = load_file(str(path))
        out["eval" if "docs" in tensors else "calib"] = tensors["tokens"]
    return out


def by_hand(args) -> dict:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    metrics = json.loads((Path(args.run) / "metrics.json").read_text())
    tokens = _tokens(Path(args.cache))
    windows = metrics["run"]["eval"]["windows"]
    calib, evals = tokens["calib"], tokens["eval"][:windows]
    batch = args.batch
    times, start = {}, time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with GpuPeak() as gpu:
        t = time.time()
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        times["load"] = time.time() - t

        def ppl() -> float:
            nll, n = 0.0, 0
            with torch.no_grad():
                for i in range(0, evals.shape[0], batch):
                    ids = evals[i:i + batch].to(device)
                    logits = model(ids).logits.float()
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                             ids[:, 1:].reshape(-1), reduction="sum")
                    nll, n = nll + float(loss), n + ids[:, 1:].numel()
            return float(torch.exp(torch.tensor(nll / n)))

        t = time.time()
        ref_ppl = ppl()
        times["reference_ppl"] = time.time() - t
        cfg = {"fp8": mtq.FP8_DEFAULT_CFG, "int4_awq": mtq.INT4_AWQ_CFG, "int8_sq": mtq.INT8_SMOOTHQUANT_CFG}[
            args.precision]

        def loop(m):
            with torch.no_grad():
                for i in range(0, calib.shape[0], 16):
                    m(calib[i:i + 16].to(device))

        t = time.time()
        mtq.quantize(model, cfg, loop)
        times["quantize"] = time.time() - t
        t = time.time()
        q_ppl = ppl()  # before the export, which leaves the model's weights as stored codes
        times["quantized_ppl"] = time.time() - t
        t = time.time()
        export_hf_checkpoint(model, export_dir=args.out)
        times["export"] = time.time() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"what": "by-hand", "precision": args.precision, "windows": int(evals.shape[0]),
            "calib_windows": int(calib.shape[0]), "seconds": {k: round(v, 1) for k, v in times.items()},
            "wall_s": round(time.time() - start, 1), "ppl_ref": ref_ppl, "ppl_quantized": q_ppl,
            "peak_rss_mib": round(rss), "peak_gpu_mib": gpu.peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    b.add_argument("--tokenizer", required=True)
    b.add_argument("--out", required=True)
    q = sub.add_parser("quantlab")
    for p in (q, sub.add_parser("by-hand")):
        p.add_argument("--model", required=True)
        p.add_argument("--precision", default="fp8")
        p.add_argument("--cache", required=True)
        p.add_argument("--run", required=True)
    q.add_argument("--data", required=True)
    q.add_argument("extra", nargs="*", help="more quantlab overrides")
    h = sub.choices["by-hand"]
    h.add_argument("--out", required=True)
    h.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    result = {"build": build, "quantlab": run_quantlab, "by-hand": by_hand}[args.cmd](args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
