"""Decode and prefill speed of the torch engine (quantlab.engines.decode) on a Llama-3.1-8B-shaped model with random
weights built on the GPU, per precision, against the HBM roofline measured in the same run; with --check, first the
correctness of every captured path. Needs a CUDA GPU (FP8 formats: sm_89+); one run fits in ~8 minutes on an H200.

    python bench/decode.py --check --out $OUT/decode.json

Precisions: bf16 (the reference: the HF model itself), fp8, fp8_kv (fp8 + FP8 KV cache), int8_sq, int4_awq. The
quantized models are exported the way the engine loads them - hf_quant_config.json + safetensors (weights quantized
from the bf16 model's, static input scales from one calibration forward, SmoothQuant / AWQ pre_quant_scales of
realistic magnitude) - and loaded by quantlab.engines.torch_engine.load_exported, so what is timed is what an
evaluation runs. Per precision and batch: prefill ms and tokens/s; decode ms/token (median and spread over repeats
of `--tokens` CUDA-graph replays), tokens/s; weight and KV bytes; the roofline (bytes a decode step reads / the
device-to-device copy bandwidth measured here) and the fraction of it reached; ratios vs bf16.
The timed decode runs the compiled layers (each row says compiled=True); the pipeline's generations and its speed
section run the uncompiled cached decode (the report's speed section says so): --no-compile times that path.

--check (each part in its own try block; a failure prints its traceback and the rest still runs):
  families  every family of tests/conftest.py's matrix (tiny random models, fp32): the captured cached decode's
            ids vs the full-sequence re-run, each captured step's logits vs the full forward's
  int4      the Triton W4A16 kernels (k8 split-K and dense paths, and the export-layout fallback) vs their exact
            arithmetic at the 8B shapes (bf16 and fp16)
  attention the Triton decode-attention kernel vs its reference (bf16 and fp16; windows, soft-capping, E4M3 cache)
            and its time at the 8B shape against the grouped sdpa it replaces
  fp8_kv    the E4M3 cache layer vs fp8_qdq, bit for bit
  model     per precision: the captured (and compiled) 8B decode vs the uncaptured one (ids) and vs the full
            forward (logits), and a profile of one uncaptured step (kernels by time)
Before the precisions are timed, the W4A16 sweep (--no-sweep skips it) times k8 configurations per decode shape
(CUDA-graph replays over weight copies larger than L2), checks each one's output against the exact arithmetic,
installs the fastest valid one in quantlab.engines.kernels.int4.CONFIGS for this run and prints the table to commit.
After each precision's batches, the attribution times batch 1 again with the decode-attention kernel off and with
the layers uncompiled (no inductor fusion), one switch at a time, in this process.
Sections are skipped (and reported so) once --budget-s is spent.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantlab.engines import decode, fusion, qlayers  # noqa: E402
from quantlab.engines.base import Engine, Limits  # noqa: E402
from quantlab.engines.hf import HFModelEngine  # noqa: E402
from quantlab.engines.kernels import device as kernel_device  # noqa: E402

START = time.time()
DEVICE = "cuda"  # --smoke: "cpu" (the script's own logic on tiny shapes, nothing timed that matters)
RESULTS: dict = {"sections": {}, "skipped": [], "errors": {}}
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
EXPORTS = {"fp8": "FP8", "fp8_kv": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ",
           "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN", "w4a8_awq": "W4A8_AWQ"}
SMALL = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2)
GROUP = 128


def elapsed() -> float:
    return time.time() - START


def say(*parts) -> None:
    print(f"[{elapsed():6.1f}s]", *parts, flush=True)


def section(name: str, cost_s: float, budget_s: float):
    """Run a section if its estimated cost fits in what is left of the budget; its errors are printed and kept."""
    def wrap(fn):
        if elapsed() + cost_s > budget_s:
            RESULTS["skipped"].append(name)
            say(f"SKIP {name}: {budget_s - elapsed():.0f}s left, needs ~{cost_s:.0f}s")
            return None
        say(f"== {name}")
        try:
            out = fn()
            RESULTS["sections"][name] = out
            return out
        except Exception:  # noqa: BLE001 - one failing section must not hide the others
            tb = traceback.format_exc()
            RESULTS["errors"][name] = tb[-4000:]
            say(f"FAILED {name}:\n{tb}")
            return None
    return wrap


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def cuda_ms(fn, iters: int) -> float:
    """Milliseconds per call of fn, by CUDA events (host clock under --smoke)."""
    if DEVICE != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / iters


# ------------------------------------------------------------------------------------------------ environment
def environment() -> dict:
    import transformers

    from quantlab.engines.torch_engine import kernel_context

    kernel_device.configure(kernel_context())  # engine.kernels' defaults and $QUANTLAB_DISABLED_KERNELS, for every run

    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    n = 1 << 30 if DEVICE == "cuda" else 1 << 22  # 2 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = min(cuda_ms(functools.partial(dst.copy_, src), 10) for _ in range(3))
    bandwidth = 2 * src.numel() * 2 / (ms / 1e3)  # bytes read + written per second
    del src, dst
    out = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)", "torch": torch.__version__,
           "transformers": transformers.__version__, "triton": triton_version, "copy_bandwidth_GBps": bandwidth / 1e9,
           "pdl": kernel_device.pdl_on(DEVICE), "kernel_switches": kernel_device.current().describe()}
    say(f"{out['gpu']}: torch {out['torch']}, transformers {out['transformers']}, triton {triton_version}; "
        f"device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write); programmatic dependent launch "
        f"{'on' if out['pdl'] else 'off'} (engine.kernels.pdl); kernels disabled: "
        f"{', '.join(out['kernel_switches']['disabled']) or 'none'} (engine.kernels.disabled, "
        f"$QUANTLAB_DISABLED_KERNELS); norm / rotary / argmax compiled "
        f"{'on' if out['kernel_switches']['compile_edges'] else 'off'} (engine.kernels.compile_edges)")
    return out


# ------------------------------------------------------------------------------------------------ checks
def family_configs() -> dict:
    """tests/conftest.py's family matrix (its _family_configs function, read from the file: the bench needs no
    pytest)."""
    tree = ast.parse((REPO / "tests" / "conftest.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_family_configs")
    scope: dict = {}
    exec(compile(ast.Module([fn], []), "conftest._family_configs", "exec"), scope)  # noqa: S102
    return scope["_family_configs"]()


def check_families(new_tokens: int = 12, prompt: int = 20) -> dict:
    from quantlab.models import attn_implementation

    out = {}
    for name, (config_cls, model_cls, kwargs) in family_configs().items():
        try:
            torch.manual_seed(0)
            config = config_cls(**kwargs, initializer_range=0.1)
            implementation = attn_implementation(config.to_dict())
            if implementation:
                config._attn_implementation = implementation
            with torch.device(DEVICE):
                model = model_cls(config).eval()
            engine = HFModelEngine(model, Limits(256, 256, 8), name)
            prompts = torch.randint(3, 500, (2, prompt), generator=torch.Generator().manual_seed(1)).to(DEVICE)
            ids = engine.greedy(prompts, new_tokens)
            info = dict(engine.decode_info)
            if info.get("cached") is False:  # the engine fell back to re-running full sequences: say why
                raise RuntimeError(f"the cached decode did not run: {info}")
            full_ids = Engine.greedy(engine, prompts, new_tokens)
            dec = decode.Decoder(model, engine.head, engine.captured.take, 2, prompt + new_tokens + 1,
                                 keep_logits=True)
            dec.prefill(prompts)
            steps = []
            for _ in range(new_tokens - 1):
                dec.step()
                steps.append(dec.logits.clone())
            seq = torch.cat([prompts, dec.out[:, prompt: prompt + new_tokens]], 1)
            with torch.no_grad():
                full = engine.forward(seq).logits(prompt, prompt + new_tokens - 1)
            got = torch.stack(steps, 1)
            err = float((got - full).abs().max() / full.abs().max().clamp_min(1.0))
            row = {"ids_equal": bool(torch.equal(ids, full_ids)), "step_logits_rel_err": err,
                   "captured": dec.graph is not None, "capture_error": dec.capture_error, "moe": info["moe"],
                   "attention": info["attention"], "windows": info["windows"],
                   "window_mismatch": sorted(map(str, dec.cache.window_mismatch))}
            if not row["ids_equal"]:  # a near-tie decided differently by two GPU reductions is not an error
                j = int((ids != full_ids).any(0).nonzero()[0])
                top2 = full[:, min(j, full.shape[1] - 1)].float().topk(2, -1).values
                row["first_divergence"] = j
                row["top2_gap_there"] = float((top2[:, 0] - top2[:, 1]).min())
            row["ok"] = (err < 1e-4 and (row["captured"] or row["moe"] or DEVICE != "cuda")
                         and not row["window_mismatch"]
                         and (row["ids_equal"] or row.get("top2_gap_there", 1.0) < 1e-3))
            dec.close()
            out[name] = row
            say(f"  {name:12s} {'ok ' if row['ok'] else 'BAD'} ids_equal={row['ids_equal']} "
                f"step_err={err:.1e} captured={row['captured']} attention={row['attention']}"
                + (f" capture_error={row['capture_error']}" if row["capture_error"] else ""))
            del engine, model, dec
        except Exception:  # noqa: BLE001
            out[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
            say(f"  {name:12s} FAILED\n{out[name]['error']}")
        empty_cache()
    return out


def check_compiled_tiny() -> dict:
    """The tiny Llama's decode with compiled layers (inductor) against the uncompiled captured decode."""
    name = "llama"
    config_cls, model_cls, kwargs = family_configs()[name]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = model_cls(config_cls(**kwargs, initializer_range=0.1)).eval()
    engine = HFModelEngine(model, Limits(256, 256, 8), name)
    prompts = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plain = engine.greedy(prompts, 12)
    engine.decode_compile = True
    t = time.time()
    compiled = engine.greedy(prompts, 12)
    out = {"ids_equal": bool(torch.equal(plain, compiled)), "seconds": time.time() - t, **engine.decode_info}
    out["ok"] = out["ids_equal"] and bool(out.get("compiled")) and (bool(out.get("captured")) or DEVICE != "cuda")
    say(f"  compiled tiny llama: ids_equal={out['ids_equal']} compiled={out['compiled']} "
        f"captured={out['captured']} ({out['seconds']:.1f}s) compile_error={out['compile_error']}")
    return out


def check_int4() -> dict:
    from quantlab.engines.kernels import int4

    if not int4.available():
        return {"ok": False, "error": "triton does not import"}
    cases = ((1, 4096, 4096, GROUP, True), (1, 14336, 4096, GROUP, False), (1, 4096, 14336, GROUP, True),
             (16, 6144, 4096, GROUP, False), (64, 1024, 4096, GROUP, True), (300, 512, 4096, 64, False))
    rows = int4.check("cuda", dtypes=(torch.bfloat16, torch.float16), cases=cases)
    bad = [r for r in rows if not r["ok"]]
    for r in rows:
        say(f"  w4a16 {r['kernel']:14s} M={r['rows']:3d} N={r['n']:5d} K={r['k']:5d} g={r['group']} "
            f"{r['dtype']:8s} worst/bound={r['worst']:.3f} {'ok' if r['ok'] else 'BAD'}"
            + (f" error={r['error']}" if "error" in r else ""))
    usable = {str(d): int4.k8_usable("cuda", d) for d in (torch.bfloat16, torch.float16)}
    usable.update({f"tensor-core {d}": int4.mma_usable("cuda", d) for d in (torch.bfloat16, torch.float16)})
    say(f"  k8 kernels usable (startup check): {usable}")
    return {"ok": not bad, "k8_usable": usable, "cases": rows}


def check_attention() -> dict:
    from quantlab.engines import decode
    from quantlab.engines.kernels import attention

    rows = attention.check("cuda", dtypes=(torch.bfloat16, torch.float16))
    for r in rows:
        say(f"  decode attention case={r['case']} {r['dtype']:8s} splits={r.get('splits')} err={r['err']:.1e} "
            f"{'ok' if r['ok'] else 'BAD'}" + (f" error={r['error']}" if "error" in r else ""))
    out = {"ok": all(r["ok"] for r in rows), "cases": rows,
           "usable_bf16": decode._kernel_usable(torch.device("cuda"), torch.bfloat16)}
    out["timing"] = time_attention()
    return out


def time_attention(batch: int = 1, length: int = 546, layers: int = 32) -> dict:
    """The kernel vs the grouped sdpa it replaces (boolean mask, as the decode built it), at the 8B shape: one call per
    layer over `layers` caches (more than L2), replayed from a CUDA graph; per-layer microseconds."""
    from quantlab.engines import decode
    from quantlab.engines.kernels import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = LLAMA_8B["num_attention_heads"], LLAMA_8B["num_key_value_heads"], 128
    q = torch.randn(batch, hq, 1, d, device="cuda", generator=g).bfloat16()
    caches = [(torch.randn(batch, hkv, length, d, device="cuda", generator=g).bfloat16(),
               torch.randn(batch, hkv, length, d, device="cuda", generator=g).bfloat16()) for _ in range(layers)]
    pos = torch.tensor([length - 2], device="cuda")
    mask = (torch.arange(length, device="cuda") <= pos)[None, None, None]

    def kernel():
        for k, v in caches:
            torch.ops.quantlab.decode_attention(q, k, v, pos, None, None, d ** -0.5, 0, 0.0)

    def sdpa():
        for k, v in caches:
            decode._grouped_sdpa(None, q, k, v, mask, scaling=d ** -0.5)

    out = {}
    for name, fn in (("triton_us", kernel), ("grouped_sdpa_us", sdpa)):
        out[name] = graph_us(fn) / layers
    out["splits"] = attention.plan(batch, hkv, length, "cuda", d)[1]
    kv_bytes = 2 * batch * hkv * length * d * 2
    say(f"  decode attention at B={batch}, {length} positions: triton {out['triton_us']:.1f} us/layer "
        f"({kv_bytes / out['triton_us'] / 1e3:.0f} GB/s), grouped sdpa {out['grouped_sdpa_us']:.1f} us/layer; "
        f"{out['splits']} splits")
    return out


def finish(res: dict, t0: float, out: str | None) -> int:
    """The end of a kernel microbenchmark (bench/int4_kernels.py, bench/fp8_kernels.py): the seconds it took,
    printed and recorded, and the results written as JSON where --out asks."""
    res["seconds"] = time.time() - t0
    print(f"done in {res['seconds']:.0f}s", flush=True)
    if out:
        Path(out).write_text(json.dumps(res, indent=1, default=str))
    return 0


def graph_us(fn, replays: int = 20) -> float:
    """Microseconds of one fn() replayed from a CUDA graph (after an eager warm-up: compilation, workspaces)."""
    fn()
    sync()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    sync()
    us = cuda_ms(graph.replay, replays) * 1e3
    del graph
    return us


def check_fp8_kv() -> dict:
    g = torch.Generator().manual_seed(0)
    k_scale, v_scale = torch.tensor(0.02, device=DEVICE), torch.tensor(0.05, device=DEVICE)
    cache = decode.StaticKV(1, 64, {0: (k_scale, v_scale)})
    key = (torch.randn(4, 8, 16, 128, generator=g) * 4).to(DEVICE).bfloat16()
    value = (torch.randn(4, 8, 16, 128, generator=g) * 20).to(DEVICE).bfloat16()
    cache.positions, cache.read_length = torch.arange(16, device=DEVICE), 16
    k, v = cache.update(key, value, 0)
    ok = bool(torch.equal(k, qlayers.fp8_qdq(key, k_scale)) and torch.equal(v, qlayers.fp8_qdq(value, v_scale)))
    out = {"ok": ok and cache.layers[0].keys.dtype == torch.uint8, "stored_dtype": str(cache.layers[0].keys.dtype)}
    say(f"  fp8 KV layer equals fp8_qdq bit for bit: {out['ok']}")
    return out


# ------------------------------------------------------------------------------------------------ the 8B model
def build_reference(layers: int, shape: dict):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, num_hidden_layers=layers)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    say(f"  bf16 {layers}-layer model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    return model


def calibrate(model, tokens: int = 128) -> dict:
    """Per Linear of the decoder: input amax (per tensor and per channel) and output amax, from one forward."""
    stats, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
            def hook(_module, args, out, name=name):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                stats[name] = {"amax": float(x.abs().max()), "channel": x.abs().amax(0),
                               "out_amax": float(out.detach().abs().max())}
            hooks.append(mod.register_forward_hook(hook))
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    ids = ids.to(DEVICE)
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
    for h in hooks:
        h.remove()
    return stats


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int codes [N, K] in -8..7 -> uint8 [N/2, K]: row 2r in the low nibble, 2r+1 in the high (two's complement)."""
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[0::2] | (u[1::2] << 4)


def quantize_linear(fmt: str, w: torch.Tensor, stat: dict, name: str, smooth: bool) -> dict:
    """One Linear's exported tensors (on the CPU), quantized from its bf16 weight."""
    w = w.float()
    out = {}
    if fmt == "fp8":
        ws = w.abs().max() / 448
        out["weight"] = (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
        out["weight_scale"], out["input_scale"] = ws.reshape(()), torch.tensor(max(stat["amax"], 1e-4) / 448)
    elif fmt == "int8_sq":
        # SmoothQuant (alpha 0.5): x * pre_quant_scale, W / pre_quant_scale, int8 per output channel
        pqs = (w.abs().amax(0).clamp_min(1e-5) / stat["channel"].clamp_min(1e-5)).sqrt().clamp(0.01, 100)
        ws_ = w / pqs[None, :]
        scale = ws_.abs().amax(1).clamp_min(1e-8) / 127
        out["weight"] = torch.round(ws_ / scale[:, None]).clamp(-128, 127).to(torch.int8)
        out["weight_scale"], out["pre_quant_scale"] = scale, pqs
        out["input_scale"] = torch.tensor(max(float((stat["channel"] * pqs).max()), 1e-4) / 127)
    elif fmt == "fp8_pc_pt":
        ws = w.abs().amax(1).clamp_min(1e-8) / 448
        out["weight"], out["weight_scale"] = (w / ws[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), ws
    elif fmt == "w4a8_awq":
        groups = w.reshape(w.shape[0], -1, GROUP)
        scale = groups.abs().amax(-1).clamp_min(1e-8) / 7
        q = torch.round(groups / scale[..., None]).clamp(-8, 7).reshape(w.shape)
        out["weight"], out["weight_scale"] = _pack_int4(q.to(torch.int8)), scale
        out["weight_scale_2"] = (scale.max() * 7 / 448).reshape(())
        out["input_scale"] = torch.tensor(max(stat["amax"], 1e-4) / 448)
    else:  # int4_awq: group scales; a pre_quant_scale where export cannot fold one into a norm (o_proj, down_proj)
        if smooth:
            pqs = (stat["channel"].clamp_min(1e-5) / stat["channel"].mean().clamp_min(1e-5)).pow(0.25).clamp(0.25, 4)
            w = w / pqs[None, :]
            out["pre_quant_scale"] = pqs
        groups = w.reshape(w.shape[0], -1, GROUP)
        scale = groups.abs().amax(-1).clamp_min(1e-8) / 7
        q = torch.round(groups / scale[..., None]).clamp(-8, 7).reshape(w.shape)
        out["weight"], out["weight_scale"] = _pack_int4(q.to(torch.int8)), scale
    return {f"{name}.{k}": v.contiguous().cpu() for k, v in out.items()}


def export_all(model, stats: dict, root: Path, precisions: list[str]) -> dict[str, Path]:
    """Write each quantized export (config.json, hf_quant_config.json, shards) under root; the unquantized tensors
    (embeddings, norms, head) are one shard shared by every export (a symbolic link in each directory)."""
    from safetensors.torch import save_file

    shared = root / "shared.safetensors"
    state = model.state_dict()
    linear = {n for n in stats}
    plain = {k: v.contiguous().cpu() for k, v in state.items()
             if k.removesuffix(".weight") not in linear and "rotary" not in k}
    save_file(plain, str(shared))
    del plain
    dirs = {}
    for prec in precisions:
        fmt = "fp8" if prec == "fp8_kv" else prec
        out = root / prec
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
        (out / "shared.safetensors").symlink_to(shared)
        weights_dir = root / fmt
        if prec == "fp8_kv":  # fp8's weights plus the KV scales
            (out / "linears.safetensors").symlink_to(weights_dir / "linears.safetensors")
            kv = {}
            for name, stat in stats.items():
                if name.endswith(("k_proj", "v_proj")):
                    kind = "k_scale" if name.endswith("k_proj") else "v_scale"
                    kv[f"{name}.{kind}"] = torch.tensor(max(stat["out_amax"], 1e-3) / 448)
            save_file(kv, str(out / "kv.safetensors"))
        else:
            tensors = {}
            for name, stat in stats.items():
                smooth = name.endswith(("o_proj", "down_proj"))
                tensors.update(quantize_linear(fmt, model.get_submodule(name).weight.detach(), stat, name, smooth))
            save_file(tensors, str(out / "linears.safetensors"))
            del tensors
        quant = {"quant_algo": EXPORTS[prec], "kv_cache_quant_algo": "FP8" if prec == "fp8_kv" else None,
                 "exclude_modules": ["lm_head"]}
        if prec in ("int4_awq", "w4a8_awq"):
            quant.update(group_size=GROUP, has_zero_point=False, pre_quant_scale=prec == "int4_awq")
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "bench/decode.py"},
                                                             "quantization": quant}))
        dirs[prec] = out
        say(f"  exported {prec} -> {out} ({sum(f.stat().st_size for f in out.glob('*.safetensors')) / 1e9:.1f} GB "
            "with the shared shard)")
    return dirs


def model_bytes(model) -> dict:
    """Bytes of every weight the model holds, and of those a decode step reads (all but the embedding table, of
    which it reads one row per sequence)."""
    total, embedding = 0, 0
    emb = model.get_input_embeddings().weight
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    # the output head is swapped for a capture inside engines: count it from the engine's head separately
    embedding = emb.numel() * emb.element_size()
    return {"weights": total, "embedding": embedding}


def engine_for(prec: str, reference, export_dirs: dict):
    if prec == "bf16":
        return HFModelEngine(reference, Limits(8192, 8192, 256), "reference")
    from quantlab.engines.torch_engine import TorchEngine, load_exported
    from quantlab.env import resolve_device

    device = resolve_device(DEVICE)
    model, plan = load_exported(export_dirs[prec], device, torch.bfloat16)
    return TorchEngine(model, Limits(8192, 8192, 256), device, plan)


def profile_step(dec) -> dict:
    """Kernels of one uncaptured decode step (compiled layers if the decoder compiles), by total time."""
    tokens, pos, position = dec.tokens.clone(), dec.pos.clone(), dec.position
    with torch.no_grad():
        dec._step(dec.max_len, dec.compile)
        sync()
        out = profile_kernels(lambda: dec._step(dec.max_len, dec.compile))
    dec.tokens.copy_(tokens)
    dec.pos.copy_(pos)
    dec.position = position
    return out


def profile_kernels(run) -> dict:
    """Kernels of one call of run(), by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    rows = [(e.key, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total, e.count)
            for e in prof.key_averages()]
    rows = [r for r in rows if r[1] > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"kernels": sum(r[2] for r in rows), "gpu_us": total,
            "top": [{"kernel": k[:90], "us": round(t, 1), "count": c} for k, t, c in rows[:40]]}


def bench_precision(prec: str, engine, args, bandwidth: float, reference_rows: dict | None) -> dict:
    model = engine.model
    sizes = model_bytes(model)
    head = engine.head_weights()[0]
    head_bytes = head.numel() * head.element_size() if head.data_ptr() not in {
        p.data_ptr() for p in model.parameters()} else 0
    weights = sizes["weights"] + head_bytes
    read_weights = weights - sizes["embedding"]
    out = {"weights_GB": weights / 1e9, "plan": getattr(engine, "plan", None), "batches": {}}
    kernels = (out["plan"] or {}).get("kernels", ["torch (bf16)"])
    say(f"  {prec}: weights {weights / 1e9:.2f} GB ({read_weights / 1e9:.2f} GB read per decode step); "
        f"kernels: {'; '.join(kernels)}")
    context = args.context
    for batch in args.batches:
        if elapsed() > args.budget_s - 20:
            RESULTS["skipped"].append(f"{prec} batch {batch}")
            say(f"  SKIP {prec} batch {batch}: budget")
            continue
        row = {}
        prompts = torch.randint(0, model.config.vocab_size, (batch, context),
                                generator=torch.Generator().manual_seed(batch)).to(DEVICE)
        compile_here = args.compile and elapsed() < args.budget_s - 90
        dec = decode.Decoder(model, engine.head, engine.captured.take, batch, context + args.tokens + 2,
                             capture=DEVICE == "cuda", compile=compile_here)
        try:
            if batch in args.prefill_batches:
                dec.prefill(prompts)
                sync()
                times = []
                for _ in range(args.repeats):
                    t = time.time()
                    dec.prefill(prompts)
                    sync()
                    times.append((time.time() - t) * 1e3)
                row["prefill_ms"] = statistics.median(times)
                row["prefill_tokens_per_s"] = batch * context / (row["prefill_ms"] / 1e3)
                if args.profile and batch == max(args.prefill_batches) and elapsed() < args.budget_s - 60:
                    row["prefill_profile"] = profile_kernels(functools.partial(dec.prefill, prompts))
                    p = row["prefill_profile"]
                    say(f"    profile of one prefill at B={batch}: {p['kernels']} kernels, {p['gpu_us'] / 1e3:.1f} ms "
                        "GPU; top: " + "; ".join(f"{k['kernel'][:48]} {k['us'] / 1e3:.1f}ms x{k['count']}"
                                                 for k in p["top"][:10]))
            dec.prefill(prompts)
            t = time.time()
            dec.step()  # warm-up, compilation and capture
            sync()
            row["first_step_s"] = time.time() - t
            info = dec.describe()
            row.update(captured=info["captured"], compiled=info["compiled"], capture_error=info["capture_error"],
                       compile_error=info["compile_error"], attention=info["attention"])
            start = dec.position
            per_token = []
            for _ in range(args.repeats):
                dec.pos.fill_(start)
                dec.position = start
                ms = cuda_ms(dec.step, args.tokens - 1)
                per_token.append(ms)
            row["decode_ms_per_token"] = statistics.median(per_token)
            row["decode_ms_spread"] = [min(per_token), max(per_token)]
            row["decode_tokens_per_s"] = batch / (row["decode_ms_per_token"] / 1e3)
            kv = dec.cache.nbytes()
            row["kv_GB"] = kv / 1e9
            step_bytes = read_weights + kv  # the captured step reads the whole static cache under its mask
            row["roofline_ms"] = step_bytes / bandwidth * 1e3
            row["roofline_fraction"] = row["roofline_ms"] / row["decode_ms_per_token"]
            if batch == args.batches[0] and args.profile and elapsed() < args.budget_s - 60:
                try:
                    row["profile"] = profile_step(dec)
                except Exception:  # noqa: BLE001
                    row["profile"] = {"error": traceback.format_exc()[-1500:]}
            if reference_rows and batch in reference_rows:
                ref = reference_rows[batch]
                if ref.get("decode_ms_per_token"):
                    row["decode_speedup_vs_bf16"] = ref["decode_ms_per_token"] / row["decode_ms_per_token"]
                if ref.get("prefill_ms") and row.get("prefill_ms"):
                    row["prefill_speedup_vs_bf16"] = ref["prefill_ms"] / row["prefill_ms"]
        finally:
            dec.close()
            del dec
            empty_cache()
        row["residual_adds_fused"] = dict(fusion.STATS)  # this process's compiled graphs so far
        out["batches"][batch] = row
        say(f"  {prec:8s} B={batch:3d} decode {row['decode_ms_per_token']:7.3f} ms/token "
            f"[{row['decode_ms_spread'][0]:.3f}-{row['decode_ms_spread'][1]:.3f}] "
            f"{row['decode_tokens_per_s']:8.0f} tok/s, roofline {row['roofline_ms']:.3f} ms "
            f"({100 * row['roofline_fraction']:.0f}%), KV {row['kv_GB']:.2f} GB"
            + (f", prefill {row['prefill_ms']:.1f} ms ({row['prefill_tokens_per_s']:.0f} tok/s)"
               if "prefill_ms" in row else "")
            + (f", x{row['decode_speedup_vs_bf16']:.2f} decode vs bf16" if "decode_speedup_vs_bf16" in row else "")
            + (f", x{row['prefill_speedup_vs_bf16']:.2f} prefill" if "prefill_speedup_vs_bf16" in row else "")
            + f"; first step {row['first_step_s']:.1f}s captured={row['captured']} compiled={row['compiled']}"
            + (f" capture_error={row['capture_error']}" if row["capture_error"] else "")
            + (f" compile_error={row['compile_error']}" if row["compile_error"] else "")
            + f"; residual adds fused so far {fusion.STATS['fused']} in {fusion.STATS['graphs']} graphs")
        if "profile" in row and "top" in row["profile"]:
            p = row["profile"]
            say(f"    profile of one uncaptured step: {p['kernels']} kernels, {p['gpu_us'] / 1e3:.2f} ms GPU; top: "
                + "; ".join(f"{k['kernel'][:48]} {k['us']:.0f}us x{k['count']}" for k in p["top"][:6]))
    return out


def check_model(prec: str, engine, args) -> dict:
    """Batch 1, the bench's cache length (so the compiled layers are the ones the bench then times): the captured
    (and compiled) greedy decode; the same tokens through the uncaptured, uncompiled cached steps (teacher-forced);
    the full forward of the whole sequence. Compared by the relative L2 error of each step's logits (bf16 with
    random weights: rounding differences are ~1e-2, a wrong position or mask is ~1) and top-1 agreement."""
    model = engine.model
    prompt, steps = min(64, args.context // 2), 8
    max_len = args.context + args.tokens + 2
    prompts = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(9))
    prompts = prompts.to(DEVICE)
    dec = decode.Decoder(model, engine.head, engine.captured.take, 1, max_len, capture=DEVICE == "cuda",
                         compile=args.compile, keep_logits=True)
    dec.prefill(prompts)
    captured = []
    for _ in range(steps - 1):
        dec.step()
        captured.append(dec.logits.clone())
    ids, info = dec.out[:, prompt: prompt + steps].clone(), dec.describe()
    dec.close()
    dec = decode.Decoder(model, engine.head, engine.captured.take, 1, max_len, capture=False, keep_logits=True)
    dec.prefill(prompts)
    eager = []
    for j in range(steps - 1):
        dec.tokens.copy_(ids[:, j: j + 1])
        dec.step()
        eager.append(dec.logits.clone())
    dec.close()
    captured, eager = torch.stack(captured, 1), torch.stack(eager, 1)
    seq = torch.cat([prompts, ids], 1)
    with torch.no_grad():
        full = engine.forward(seq).logits(prompt, prompt + steps - 1)
        # the rounding floor of this model and precision: the same sequence's full forward beside another
        # sequence (twice the GEMM rows: other kernels and split orders, the same numerics). A random-weight
        # 32-layer model amplifies rounding, and FP8 activations flip E4M3 roundings, so this floor, not a fixed
        # number, says how far two correct computations of the same logits drift apart
        other = torch.randint(0, model.config.vocab_size, seq.shape, generator=torch.Generator().manual_seed(10))
        pair = engine.forward(torch.cat([seq, other.to(DEVICE)], 0)).logits(prompt, prompt + steps - 1)[:1]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    out = {"captured_vs_uncaptured_rel_l2": rel(captured, eager), "captured_vs_full_rel_l2": rel(captured, full),
           "uncaptured_vs_full_rel_l2": rel(eager, full),
           "full_batch2_vs_full_rel_l2": rel(pair, full),
           "top1_agreement_vs_full": float((captured.argmax(-1) == full.argmax(-1)).float().mean()),
           "captured": info["captured"], "compiled": info["compiled"], "compile_error": info["compile_error"],
           "capture_error": info["capture_error"], "attention": info["attention"]}
    # FP8 activations amplify rounding differences (one flipped E4M3 rounding is a 1/8 step): 3e-2 seen on the
    # CPU for W4A8; a wrong position, mask or cache read gives ~1 (unrelated logits)
    # CPU for W4A8; a wrong position, mask or cache read gives ~1 (unrelated logits). The decode may drift from the
    # full forward by 3x the model's own rounding floor when that floor is above 0.2/3
    bound = max(0.2, 3 * out["full_batch2_vs_full_rel_l2"])
    out["ok"] = (out["captured_vs_uncaptured_rel_l2"] < 0.2 and out["captured_vs_full_rel_l2"] < bound
                 and (info["captured"] or DEVICE != "cuda"))
    say(f"  check {prec}: {'ok' if out['ok'] else 'BAD'} step logits rel L2: captured vs uncaptured "
        f"{out['captured_vs_uncaptured_rel_l2']:.1e}, captured vs full forward {out['captured_vs_full_rel_l2']:.1e}, "
        f"uncaptured vs full {out['uncaptured_vs_full_rel_l2']:.1e}, rounding floor (full forward at batch 2 vs 1) "
        f"{out['full_batch2_vs_full_rel_l2']:.1e}; top-1 agreement "
        f"{out['top1_agreement_vs_full']:.2f}; captured={info['captured']} compiled={info['compiled']} "
        f"attention={info['attention']}" + (f" compile_error={info['compile_error']}" if info["compile_error"] else ""))
    return out


def check_other_formats(args) -> dict:
    """FP8 per-channel/per-token and W4A8-AWQ (not timed): a 2-layer model of a smaller shape exported in each,
    its captured (and, while the budget allows, compiled) decode against the uncaptured one and the full forward."""
    model = build_reference(2, SMALL)
    stats = calibrate(model)
    root = Path(tempfile.mkdtemp(prefix="quantlab_decode_small_"))
    out = {}
    try:
        dirs = export_all(model, stats, root, ["fp8_pc_pt", "w4a8_awq"])
        for prec, path in dirs.items():
            engine = engine_for(prec, None, {prec: path})
            small_args = argparse.Namespace(**{**vars(args), "context": 128, "tokens": 8,
                                               "compile": args.compile and elapsed() < args.budget_s})
            try:
                out[prec] = check_model(prec, engine, small_args)
            except Exception:  # noqa: BLE001
                out[prec] = {"ok": False, "error": traceback.format_exc()[-2000:]}
                say(f"  check {prec} FAILED\n{out[prec]['error']}")
            engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["ok"] = all(v.get("ok") for k, v in out.items() if isinstance(v, dict))
    return out


SWEEP_SHAPES = ((28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096))  # gate|up, down, q|k|v, o: most bytes first
L2_BYTES = 200e6  # weights cycled per timing: more than the H200's L2 holds


def _sweep_tensors(rows: int, n: int, k: int, g) -> dict:
    """Random codes / scales / inputs for one shape, copies enough to exceed L2, and the exact answer with its bound
    for the first copy (every configuration's output is checked against it)."""
    from quantlab.engines.kernels import int4

    copies = max(1, math.ceil(L2_BYTES / (n * k / 2)))
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    layers = []
    for _ in range(copies):
        packed = torch.randint(0, 256, (n // 2, k), device="cuda", dtype=torch.uint8, generator=g)
        scales = (torch.rand(n, k // GROUP, device="cuda", generator=g) * 0.01 + 1e-3).bfloat16()
        layers.append((packed, scales, *int4.repack(packed, scales)))
    w = int4.k8_dequantized(layers[0][2], layers[0][3], GROUP)
    exact, bound = int4.bound(x, w, torch.bfloat16)
    return {"x": x, "layers": layers, "exact": exact, "bound": bound, "copies": copies}


def _dense_us(x: torch.Tensor, n: int, k: int, g, fp8: bool) -> float:
    """bf16 (cuBLAS) or FP8 (torch._scaled_mm, unit scales) microseconds per call, over copies larger than L2."""
    copies = max(1, math.ceil(L2_BYTES / (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies)]
    if not fp8:
        return graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / len(ws)
    w8s = [w.to(torch.float8_e4m3fn) for w in ws]
    ws.clear()
    one, x8 = torch.ones((), device="cuda"), qlayers._pad_rows(x.to(torch.float8_e4m3fn), 16)
    return graph_us(lambda: [torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                             for w8 in w8s]) / len(w8s)


def _sweep_refs(n: int, k: int, t: dict, g) -> dict:
    """bf16 and FP8 at the same shape, and the int4 kernels before this change (export layout) and the k8
    default, microseconds per call."""
    from quantlab.engines.kernels import int4

    x, layers = t["x"], t["layers"]
    out = {"bf16_us": _dense_us(x, n, k, g, False), "fp8_us": _dense_us(x, n, k, g, True)}
    out["export_us"] = graph_us(lambda: [int4.w4a16_launch(x, p, s, None, GROUP) for p, s, _, _ in layers]) / len(
        layers)
    out["k8_default_us"] = graph_us(lambda: [int4.k8_launch(x, q, st, None, GROUP) for _, _, q, st in layers]) / len(
        layers)
    return out


def _sweep_config(t: dict, cfg: dict) -> tuple[float, str | None]:
    """(microseconds per call, None) of one k8 configuration, or (inf, why) when it fails or is not exact."""
    from quantlab.engines.kernels import int4

    x, layers = t["x"], t["layers"]
    try:
        y = int4.k8_launch(x, layers[0][2], layers[0][3], None, GROUP, config=cfg)
        sync()
        worst = float(((y.double() - t["exact"]).abs() / t["bound"]).max())
        if not worst <= 1.0:
            return float("inf"), f"inexact: worst/bound {worst:.2f}"
        return graph_us(lambda: [int4.k8_launch(x, q, st, None, GROUP, config=cfg) for _, _, q, st in layers]) / len(
            layers), None
    except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or run is skipped
        int4.reset_counters()
        return float("inf"), f"{type(exc).__name__}: {str(exc)[:120]}"


def _sweep_shape(rows: int, n: int, k: int, g, bandwidth: float, deadline: float) -> dict:
    from quantlab.engines.kernels import int4

    t = _sweep_tensors(rows, n, k, g)
    out = _sweep_refs(n, k, t, g)
    timings = []
    for cfg in int4.sweep_candidates(rows, n, k):
        if time.time() > deadline:
            timings.append({"us": float("inf"), **cfg, "error": "not timed: --sweep-s spent"})
            continue
        us, why = _sweep_config(t, cfg)
        timings.append({"us": round(us, 2), **cfg, **({"error": why} if why else {})})
    best = min(timings, key=lambda r: r["us"]) if timings else {"us": float("inf")}
    int4_bytes = n * k / 2 + n * k / GROUP * 2
    out.update(best_us=best["us"], all=timings, copies=t["copies"],
               best_config={key: v for key, v in best.items() if key not in ("us", "error")},
               best_GBps=int4_bytes / (best["us"] / 1e6) / 1e9 if math.isfinite(best["us"]) else 0.0)
    out["best_fraction_of_copy"] = out["best_GBps"] * 1e9 / bandwidth
    if math.isfinite(best["us"]) and best["us"] <= out["k8_default_us"]:
        int4.CONFIGS[(int4.m_bucket(rows), n, k)] = out["best_config"]
    return out


def int4_sweep(bandwidth: float, deadline: float) -> dict:
    """k8 W4A16 configurations at the 8B decode shapes (q|k|v and gate|up fused widths), each checked for exactness
    and timed from CUDA-graph replays over weight copies larger than L2; the fastest valid one per shape is installed
    for this run (int4.CONFIGS) and printed as the table to commit. bf16 (cuBLAS), FP8 (torch._scaled_mm) and the
    previous int4 kernels (export layout) at the same shapes for comparison."""
    from quantlab.engines.kernels import int4

    if not int4.k8_usable("cuda", torch.bfloat16):
        say("  k8 kernels failed their startup check: the engine runs the export-layout kernels; no sweep")
        return {"k8_usable": False}
    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 16):
        for n, k in SWEEP_SHAPES:
            key = f"M{rows}_N{n}_K{k}"
            r = out[key] = _sweep_shape(rows, n, k, g, bandwidth, deadline)
            say(f"  {key:18s} bf16 {r['bf16_us']:6.1f}us fp8 {r['fp8_us']:6.1f}us | int4 export "
                f"{r['export_us']:6.1f}us "
                f"k8 default {r['k8_default_us']:6.1f}us best {r['best_us']:6.1f}us = {r['best_GBps']:.0f} GB/s "
                f"({100 * r['best_fraction_of_copy']:.0f}% of copy) {r['best_config']}")
            failed = [c for c in r["all"] if "error" in c]
            if failed:
                say(f"    {len(failed)} configurations skipped, e.g. {failed[0]}")
            empty_cache()
    table = {key: cfg for key, cfg in sorted(int4.CONFIGS.items())}
    say("  int4.CONFIGS for this GPU (commit into quantlab/engines/kernels/int4/configs.py):")
    print("CONFIGS = {\n" + "".join(f"    {key}: {cfg},\n" for key, cfg in table.items()) + "}", flush=True)
    out["configs"] = {str(key): cfg for key, cfg in table.items()}
    return out


# ------------------------------------------------------------------------------------------------ attribution
ATTRIBUTION = (("attention kernel off", {"attention_kernel": False}, True),
               ("layers uncompiled (no inductor fusion)", {}, False))


def _decode_ms(engine, args, compile_layers: bool) -> tuple[float, dict]:
    """Batch-1 decode ms/token at the bench's context (captured), as bench_precision times it."""
    model = engine.model
    prompts = torch.randint(0, model.config.vocab_size, (1, args.context),
                            generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dec = decode.Decoder(model, engine.head, engine.captured.take, 1, args.context + args.tokens + 2,
                         capture=DEVICE == "cuda", compile=compile_layers)
    try:
        dec.prefill(prompts)
        dec.step()
        sync()
        start, times = dec.position, []
        for _ in range(3):
            dec.pos.fill_(start)
            dec.position = start
            times.append(cuda_ms(dec.step, args.tokens - 1))
        return statistics.median(times), dec.describe()
    finally:
        dec.close()
        empty_cache()


def attribution(prec: str, engine, args, base_ms: float | None) -> dict:
    """Batch 1 with one switch off at a time (decode.FEATURES, layer compilation), against the timed default."""
    out = {"default_ms": base_ms}
    for name, features, compile_layers in ATTRIBUTION:
        saved = dict(decode.FEATURES)
        decode.FEATURES.update(features)
        try:
            ms, info = _decode_ms(engine, args, compile_layers and args.compile)
            out[name] = {"ms": ms, "attention": info["attention"], "compiled": info["compiled"]}
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()[-1500:]}
        finally:
            decode.FEATURES.clear()
            decode.FEATURES.update(saved)
            torch._dynamo.reset()
            decode._COMPILED.clear()
    parts = [f"{name} {r['ms']:.3f} ms" + (f" (+{r['ms'] - base_ms:.3f})" if base_ms else "")
             if "ms" in r else f"{name} FAILED" for name, r in out.items() if name != "default_ms"]
    say(f"  attribution {prec} B=1: default {base_ms or math.nan:.3f} ms; " + "; ".join(parts))
    return out


# ------------------------------------------------------------------------------------------------ main
def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="correctness checks before the bench")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prefill-batches", default="1,16", help="batches whose prefill is timed")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precisions", default="bf16,int4_awq,fp8,int8_sq,fp8_kv")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="capture the decode step without compiling its layers")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the W4A16 config sweep")
    parser.add_argument("--sweep-s", type=float, default=150.0,
                        help="time for the sweep's configurations (then each remaining shape keeps its default)")
    parser.add_argument("--no-attribution", dest="attribution", action="store_false",
                        help="skip timing batch 1 with each switch off")
    parser.add_argument("--attribution-precisions", default="bf16,int4_awq,fp8,fp8_kv")
    parser.add_argument("--budget-s", type=float, default=470.0,
                        help="stop starting sections after this (a batch compiles its layers while 90 s are left)")
    parser.add_argument("--workdir", default=None, help="where the exports are written (default: /dev/shm or tmp)")
    parser.add_argument("--out", default=None, help="JSON results (default: $OUT/decode.json when OUT is set)")
    parser.add_argument("--smoke", action="store_true",
                        help="run the script's logic on the CPU with a tiny Llama (no GPU: nothing it times counts)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prefill_batches = [int(b) for b in args.prefill_batches.split(",")]
    args.attribution_precisions = args.attribution_precisions.split(",")
    return args


def run_checks(args, budget: float) -> None:
    section("check_fp8_kv", 2, budget)(check_fp8_kv)
    if DEVICE == "cuda":
        section("check_int4_kernels", 15, budget)(check_int4)
        section("check_attention", 15, budget)(check_attention)
    section("check_families", 40, budget)(check_families)
    if args.compile:
        section("check_compiled_tiny", 30, budget)(check_compiled_tiny)


def export_models(args, reference, precisions: list[str], budget: float) -> tuple[dict, Path | None]:
    quantized = [p for p in precisions if p != "bf16"]
    if reference is None or not quantized:
        return {}, None
    shm = Path("/dev/shm")
    base = args.workdir or (str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 40e9 else None)
    workroot = Path(tempfile.mkdtemp(prefix="quantlab_decode_", dir=base))

    def do_export():
        stats = calibrate(reference)
        return {k: str(v) for k, v in export_all(reference, stats, workroot, quantized).items()}
    return section("export", 60, budget)(do_export) or {}, workroot


def bench_one(prec: str, engine, args, bandwidth: float, reference_rows: dict | None) -> dict:
    """The checks of one precision's model, its batches, and the batch-1 attribution."""
    out = {}
    if args.check:
        try:
            out["check"] = check_model(prec, engine, args)
        except Exception:  # noqa: BLE001
            out["check"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            say(f"  check {prec} FAILED\n{out['check']['error']}")
    out.update(bench_precision(prec, engine, args, bandwidth, reference_rows))
    if args.attribution and prec in args.attribution_precisions and elapsed() < args.budget_s - 40:
        base = out["batches"].get(1, {}).get("decode_ms_per_token")
        out["attribution"] = attribution(prec, engine, args, base)
    return out


def bench_all(args, shape: dict, precisions: list[str], bandwidth: float, budget: float) -> None:
    reference = section("build_bf16", 15, budget)(functools.partial(build_reference, args.layers, shape))
    export_dirs, workroot = export_models(args, reference, precisions, budget)
    reference_rows = None
    for prec in precisions:
        if prec != "bf16" and prec not in export_dirs:
            RESULTS["skipped"].append(f"bench {prec} (no export)")
            continue

        def run(prec=prec, reference=reference, reference_rows=reference_rows):
            engine = engine_for(prec, reference, {k: Path(v) for k, v in export_dirs.items()})
            try:
                return bench_one(prec, engine, args, bandwidth, reference_rows)
            finally:
                if prec != "bf16":
                    engine.close()
                del engine
                torch._dynamo.reset()
                decode._COMPILED.clear()
                empty_cache()
        res = section(f"bench_{prec}", 45, budget)(run)
        del run
        if prec == "bf16":
            reference_rows = res["batches"] if res else None
            if reference is not None:
                del reference
                reference = None
                empty_cache()
    if workroot is not None:
        shutil.rmtree(workroot, ignore_errors=True)


def main() -> int:
    args = parse_args()
    global DEVICE
    shape = dict(LLAMA_8B)
    if args.smoke:
        DEVICE = "cpu"
        shape.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2)
        args.compile, args.sweep, args.profile = False, False, False
    precisions = args.precisions.split(",")
    out_path = args.out or (os.path.join(os.environ["OUT"], "decode.json") if os.environ.get("OUT") else None)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench/decode.py needs a CUDA GPU (or --smoke)")
        return 2
    RESULTS["args"] = vars(args)
    budget = args.budget_s

    env = section("environment", 5, budget)(environment) or {}
    bandwidth = env.get("copy_bandwidth_GBps", 4000) * 1e9
    if args.check:
        run_checks(args, budget)
    if args.sweep and DEVICE == "cuda" and "int4_awq" in precisions:
        section("int4_sweep", 60, budget)(functools.partial(int4_sweep, bandwidth, time.time() + args.sweep_s))
    bench_all(args, shape, precisions, bandwidth, budget)
    if args.check:
        section("check_other_formats", 40, budget + 20)(functools.partial(check_other_formats, args))

    summary(precisions, args)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(RESULTS, indent=1, default=str))
        say(f"results -> {out_path}")
    return 0 if not RESULTS["errors"] else 1


def summary_extras(precisions) -> None:
    """The batch-1 attribution table and the W4A16 sweep's best kernels per shape."""
    names = [name for name, _, _ in ATTRIBUTION]
    rows = {p: (RESULTS["sections"].get(f"bench_{p}") or {}).get("attribution") for p in precisions}
    if any(rows.values()):
        print("  attribution, B=1 decode ms/token (one switch off at a time): precision | default | "
              + " | ".join(names))
        for p, r in rows.items():
            if r:
                cells = " | ".join(f"{r[n]['ms']:.3f}" if "ms" in r.get(n, {}) else "--" for n in names)
                print(f"    {p:9s} | {r['default_ms'] or math.nan:.3f} | {cells}")
    sweep = RESULTS["sections"].get("int4_sweep") or {}
    for key, r in sweep.items():
        if isinstance(r, dict) and "best_us" in r:
            print(f"  int4 {key:18s} export {r['export_us']:6.1f}us -> k8 {r['best_us']:6.1f}us "
                  f"({r['best_GBps']:.0f} GB/s, {100 * r['best_fraction_of_copy']:.0f}% of copy; "
                  f"bf16 {r['bf16_us']:.1f}us, fp8 {r['fp8_us']:.1f}us)")


def summary(precisions, args) -> None:
    """The compact table, and the targets of the issue at batch 1."""
    say("== summary (decode ms/token; x = speedup vs bf16; % = of the measured-bandwidth roofline)")
    rows = {p: (RESULTS["sections"].get(f"bench_{p}") or {}).get("batches", {}) for p in precisions}
    header = ("precision " + "".join(f"| B={b:<3d} ms/tok   x     %  " for b in args.batches)
              + f"| prefill x vs bf16 (B={','.join(map(str, args.prefill_batches))})")
    print(header)
    for p in precisions:
        cells = ""
        for b in args.batches:
            r = rows[p].get(b, {})
            ms = r.get("decode_ms_per_token")
            mark = ("!" if r.get("compile_error") else "*") if args.compile and r.get("compiled") is False else " "
            cells += (f"| {ms:8.3f}{mark}{r.get('decode_speedup_vs_bf16', 1.0 if p == 'bf16' else math.nan):5.2f} "
                      f"{100 * r.get('roofline_fraction', math.nan):4.0f}  " if ms else "|     --                  ")
        pre = " ".join(f"{rows[p].get(b, {}).get('prefill_speedup_vs_bf16', 1.0 if p == 'bf16' else math.nan):.2f}"
                       for b in args.prefill_batches)
        print(f"{p:9s} {cells}| {pre}")
    batches = sorted(set(args.batches) | set(args.prefill_batches))
    uncompiled = {(p, b) for p in precisions for b in batches  # skipped for the budget (a failure is a result)
                  if args.compile and rows[p].get(b, {}).get("compiled") is False
                  and not rows[p].get(b, {}).get("compile_error")}
    if uncompiled:
        print("  * layers not compiled (the budget ran out before this batch: raise --budget-s); not comparable")
    if any(r.get("compile_error") for p in precisions for r in rows[p].values()):
        print("  ! compiling the layers failed (compile_error in the row): measured uncompiled")
    b1 = args.batches[0]
    get = lambda p, k: rows.get(p, {}).get(b1, {}).get(k)  # noqa: E731
    targets = [("bf16 decode >= 50% of roofline", get("bf16", "roofline_fraction"), 0.5, {("bf16", b1)}),
               ("fp8 decode >= 1.6x bf16", get("fp8", "decode_speedup_vs_bf16"), 1.6, {("fp8", b1), ("bf16", b1)}),
               ("int4_awq decode >= 2.5x bf16", get("int4_awq", "decode_speedup_vs_bf16"), 2.5,
                {("int4_awq", b1), ("bf16", b1)}),
               ("int8_sq decode >= 1.0x bf16", get("int8_sq", "decode_speedup_vs_bf16"), 1.0,
                {("int8_sq", b1), ("bf16", b1)}),
               ("fp8 prefill >= 1.4x bf16 (B=16)",
                rows.get("fp8", {}).get(16, {}).get("prefill_speedup_vs_bf16"), 1.4, {("fp8", 16), ("bf16", 16)})]
    RESULTS["targets"] = {}
    for name, value, goal, parts in targets:
        if parts & uncompiled:  # measured with the layers uncompiled: no verdict
            RESULTS["targets"][name] = {"value": value, "met": None, "uncompiled": True}
            print(f"  target {name:36s} NOT MEASURED (layers uncompiled: budget)")
            continue
        met = value is not None and value >= goal
        RESULTS["targets"][name] = {"value": value, "met": met}
        print(f"  target {name:36s} {'MET ' if met else 'MISS'} ({'--' if value is None else f'{value:.2f}'})")
    summary_extras(precisions)
    checks = {k: v for k, v in RESULTS["sections"].items() if k.startswith("check")}
    for k, v in checks.items():
        ok = None
        if isinstance(v, dict):
            ok = v["ok"] if "ok" in v else all(r.get("ok") for r in v.values() if isinstance(r, dict))
        print(f"  {k:24s} {'ok' if ok else 'BAD' if ok is False else '?'}")
    for p in precisions:
        c = (RESULTS["sections"].get(f"bench_{p}") or {}).get("check")
        if c:
            print(f"  check_model_{p:12s} {'ok' if c.get('ok') else 'BAD'}")
    if RESULTS["errors"]:
        print("  errors in:", ", ".join(RESULTS["errors"]))
    if RESULTS["skipped"]:
        print("  skipped:", ", ".join(RESULTS["skipped"]))


if __name__ == "__main__":
    sys.exit(main())
