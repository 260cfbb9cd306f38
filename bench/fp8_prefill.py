"""FP8 engine prefill vs bf16 on a Llama-8B-shaped model with random weights (needs a GPU with FP8: sm_89+).

Both runs use the same HF skeleton; the FP8 one has every decoder Linear replaced by quantlab's Fp8Linear
(static per-tensor scales from one calibration forward, torch._scaled_mm), timed first one quantize + GEMM per
Linear, then with q/k/v and gate/up fused as the torch engine runs them (fusion_fp8.fuse_shared_inputs). Prints prefill
tokens/s, the linear layers' achieved TFLOP/s, the measured bf16 / FP8 GEMM ceilings, the kernels the profiler saw,
and the FP8 / bf16 ratio against the 1.4x target.

    python bench/fp8_prefill.py --layers 8 --batch 4 --seq 2048 [--out results.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from quantlab.engines import fusion_fp8, qlayers


def timed(fn, iters: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def gemm_ceilings(n: int = 8192) -> dict:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_bf16 = timed(lambda: a @ b, iters=20)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    t_fp8 = timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters=20)
    flops = 2 * n ** 3
    return {"bf16_tflops": flops / t_bf16 / 1e12, "fp8_tflops": flops / t_fp8 / 1e12}


def to_fp8(model, calib_ids) -> int:
    """Replace decoder Linears by Fp8Linear with max-calibrated static scales (what ModelOpt's FP8 export holds)."""
    amax, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "layers" in name:
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, n=name: amax.__setitem__(n, max(amax.get(n, 0.0), float(i[0].abs().max())))))
    with torch.no_grad():
        model(calib_ids, use_cache=False, logits_to_keep=1)
    for h in hooks:
        h.remove()
    for name, a in amax.items():
        parent, _, child = name.rpartition(".")
        lin = model.get_submodule(name)
        ws = lin.weight.detach().abs().max().float() / 448
        w8 = (lin.weight.detach().float() / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
        layer = qlayers.Fp8Linear(w8, ws, torch.tensor(a / 448), None, native=True).cuda()
        setattr(model.get_submodule(parent), child, layer)
    return len(amax)


def linear_flops(model, tokens: int) -> float:
    params = sum(m.in_features * m.out_features for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "layers" in n)
    return 2.0 * tokens * params


def diagnose(tokens: int = 8192, k: int = 4096, n: int = 14336) -> dict:
    """Split one FP8 layer's time: activation quantize, the FP8 GEMM alone, the whole layer, vs bf16."""
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ws = w.abs().max().float() / 448
    layer = qlayers.Fp8Linear((w.float() / ws).to(torch.float8_e4m3fn), ws, x.abs().max().float() / 448, None,
                              native=True).cuda()
    xq = qlayers.fp8_quantize(x, layer.inv_input_scale)
    out = {
        "bf16_linear_ms": timed(lambda: torch.nn.functional.linear(x, w), iters=20) * 1e3,
        "fp8_quantize_fused_ms": timed(lambda: qlayers.fp8_quantize(x, layer.inv_input_scale), iters=20) * 1e3,
        "fp8_quantize_eager_ms": timed(lambda: qlayers._fp8_quantize_eager(x, layer.inv_input_scale), iters=20) * 1e3,
        "fp8_gemm_only_ms": timed(lambda: torch._scaled_mm(xq, layer.weight.t(), scale_a=layer.input_scale,
                                                           scale_b=layer.weight_scale, out_dtype=torch.bfloat16),
                                  iters=20) * 1e3,
        "fp8_layer_ms": timed(lambda: layer(x), iters=20) * 1e3,
    }
    print(json.dumps(out, indent=2))
    return out


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out")
    ap.add_argument("--diagnose", action="store_true", help="also time the parts of one FP8 layer")
    args = ap.parse_args()
    parts = diagnose() if args.diagnose else None
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    tokens = args.batch * args.seq
    flops = linear_flops(model, tokens)

    def prefill():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    ref_logits = prefill().float()
    t_bf16 = timed(prefill)
    n = to_fp8(model, ids[:1])
    unfused_logits = prefill().float()
    t_unfused = timed(prefill)
    groups = fusion_fp8.fuse_shared_inputs(model, torch.bfloat16)  # what the torch engine does on FP8 GPUs
    fp8_logits = prefill().float()
    t_fp8 = timed(prefill)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill()
        torch.cuda.synchronize()
    if args.diagnose:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    kernels = sorted({e.key for e in prof.key_averages()
                      if any(s in e.key.lower() for s in ("gemm", "e4m3", "scaled", "fp8", "sm90"))})
    result = {
        "shape": f"Llama-8B layer shape x {args.layers} layers, batch {args.batch} x {args.seq} tokens",
        "fp8_layers": n, "fused_quantize": qlayers._fused.get("ok", True),
        "bf16_prefill_s": t_bf16, "fp8_prefill_s": t_fp8,
        "bf16_tokens_per_s": tokens / t_bf16, "fp8_tokens_per_s": tokens / t_fp8,
        "bf16_linear_tflops": flops / t_bf16 / 1e12, "fp8_linear_tflops": flops / t_fp8 / 1e12,
        "ratio_fp8_over_bf16": t_bf16 / t_fp8, "target": 1.4,
        "shared_input_groups": groups, "fp8_unfused_prefill_s": t_unfused,
        "ratio_unfused_over_bf16": t_bf16 / t_unfused,
        "fused_vs_unfused_max_abs_logit_diff": float((fp8_logits - unfused_logits).abs().max()),
        "last_token_top1_agree": float((ref_logits.argmax(-1) == fp8_logits.argmax(-1)).float().mean()),
        "ceilings": gemm_ceilings(), "kernels": kernels[:12], "gpu": torch.cuda.get_device_name(),
        "layer_parts_ms": parts,
    }
    print(json.dumps(result, indent=2))
    print(f"FP8 / bf16 prefill speed: {result['ratio_fp8_over_bf16']:.2f}x with q/k/v and gate/up sharing one quantize "
          f"+ one GEMM ({groups} groups), {result['ratio_unfused_over_bf16']:.2f}x one per Linear (target >= 1.4x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
