"""Checkpoints from other tools: quantlab's torch engine (engine.checkpoint=) against an independent dequantizer.

For each checkpoint, two fp32 models on the same token windows:
- the engine: quantlab.engines.torch_engine.load_exported (the format detected from the files, its own numerics);
- the independent one: the fp32 reference with its Linear weights replaced by an independent dequantizer's (a
  directory of plain-torch dequantizers written apart from quantlab, --deq), the checkpoint's own unquantized float
  tensors copied in (SmoothQuant / AWQ fold scales into the norms), and the format's activation fake-quant as a
  forward pre-hook on the 7 Linears of every layer.
Printed per checkpoint: max |logit difference| and its ratio to the logits' spread, top-1 agreement, each model's
perplexity and its ratio to the reference's. One JSON line per checkpoint with --json.

    python bench/crosstool_check.py --ref REF --deq DEQ_DIR --data DATA_DIR CKPT [CKPT ...]

DEQ_DIR holds ct.py, gptq.py, awq.py, gguf_deq.py and common.py (a `dequant(path)` each); DATA_DIR a data.py with
eval_windows(tokenizer) (the windows the tools' own perplexities were measured on).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

F16_LIBRARY = "--fp32-gptq" not in sys.argv  # GPTQ / AWQ truth as the library computes it (f16), or exact fp32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def independent(ckpt: Path, ref, fmt: str, scheme: str):
    """The reference model with the independent dequantizer's weights, the checkpoint's float tensors, and hooks."""
    import common  # the independent harness (DEQ_DIR)

    model = ref
    sd = model.state_dict()
    if fmt == "gguf":
        import gguf_deq

        file = ckpt if ckpt.is_file() else next(ckpt.glob("*.gguf"))
        weights, _types, _kv = gguf_deq.dequant(str(file), linears_only=False)
        weights = {k: v for k, v in weights.items() if k in sd}
    elif fmt == "compressed-tensors":
        import ct

        weights = {**common.passthrough(str(ckpt), sd), **ct.dequant(str(ckpt))}
    else:
        import awq
        import gptq

        qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
        layout = qc.get("checkpoint_format") or qc.get("format")
        deq = awq.dequant if layout == "gemm" else gptq.dequant
        # the library dequantizes in its scales' dtype (F16): the exact fp32 product rounded to it
        weights = {k: v.to(torch.float16).float() if F16_LIBRARY else v for k, v in deq(str(ckpt)).items()}
        weights = {**common.passthrough(str(ckpt), sd), **weights}
    act = "fp8_token" if "fp8 per-token" in scheme else "int8_token" if "int8 per-token" in scheme else None
    n, _hooks = common.apply(model, weights, act)
    return model, n, act


@torch.no_grad()
def logits_of(model, windows):
    """Logits of every window, [W, T, V] fp32."""
    return torch.stack([model(torch.tensor([w])).logits[0].float() for w in windows])


def ppl(logits: torch.Tensor, windows) -> float:
    """exp(mean NLL) over every predicted token of every window."""
    ids = torch.tensor(windows)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(float(nll))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpts", nargs="+", type=Path)
    ap.add_argument("--ref", type=Path, required=True)
    ap.add_argument("--deq", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fp32-gptq", action="store_true", help="GPTQ / AWQ truth in exact fp32, not rounded to f16")
    args = ap.parse_args()
    sys.path[:0] = [str(args.deq), str(args.data)]
    import data
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantlab.engines.torch_engine import load_exported
    from quantlab.env import resolve_device
    from quantlab.formats import open_checkpoint

    tok = AutoTokenizer.from_pretrained(args.ref)
    windows = data.eval_windows(tok)[-args.windows:]

    def reference():
        return AutoModelForCausalLM.from_pretrained(args.ref, dtype=torch.float32).eval()

    ref_logits = logits_of(reference(), windows)
    ref_ppl = ppl(ref_logits, windows)
    print(f"reference ppl {ref_ppl:.4f} on {len(windows)} windows x {len(windows[0])} tokens", flush=True)
    for ckpt in args.ckpts:
        t0 = time.time()
        opened = open_checkpoint(ckpt)
        engine, plan = load_exported(ckpt, resolve_device("cpu"), torch.float32)
        a = logits_of(engine.eval(), windows)
        del engine
        indep, n, act = independent(ckpt, reference(), opened.format, "; ".join(plan["kernels"]))
        b = logits_of(indep, windows)
        del indep
        diff = (a - b).abs()
        row = {"checkpoint": ckpt.name, "format": opened.format, "scheme": opened.scheme, "kv_cache": plan["kv_cache"],
               "independent_weights": n, "independent_act": act,
               "max_abs_logit_diff": float(diff.max()), "rel_logit_diff": float(diff.max() / b.std()),
               "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
               "ppl_engine": ppl(a, windows), "ppl_independent": ppl(b, windows), "ppl_reference": ref_ppl,
               "seconds": round(time.time() - t0, 1)}
        row["ppl_ratio_engine"] = row["ppl_engine"] / ref_ppl
        row["ppl_ratio_independent"] = row["ppl_independent"] / ref_ppl
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{ckpt.name}: {opened.format} ({opened.scheme}); max|dlogit| {row['max_abs_logit_diff']:.3g} "
                  f"({row['rel_logit_diff']:.2g} of the logits' std), top-1 {row['top1_agreement']:.4f}, ppl ratio "
                  f"engine {row['ppl_ratio_engine']:.4f} / independent {row['ppl_ratio_independent']:.4f} "
                  f"({row['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
