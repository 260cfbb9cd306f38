"""Decode and prefill speed of the torch engine (quantlab.engines.decode) on a Llama-3.1-8B-shaped model with random
weights built on the GPU, per precision, against the HBM roofline measured in the same run; with --check, first the
correctness of every captured path. Needs a CUDA GPU (FP8 formats: sm_89+); one run fits in ~8 minutes on an H200.

    python bench/decode.py --check --out $OUT/decode.json

Precisions: bf16 (the reference: the HF model itself), fp8, fp8_kv (fp8 + FP8 KV cache), int8_sq, int4_awq. Where
the quantized models come from (PROVENANCE, printed in the header and the summary, kept in the JSON): the bench's own
helpers (calibrate, quantize_linear, export_all: round-to-nearest weights quantized from the bf16 model's, static
input scales from one calibration forward, SmoothQuant / AWQ-shaped pre_quant_scales of realistic magnitude by a
closed formula - no AWQ search), written as hf_quant_config.json + safetensors in the layout ModelOpt's HF export
writes - not quantlab's pipeline, not ModelOpt - and loaded by quantlab.engines.torch_engine.load_exported, so the
kernels timed are the ones an evaluation runs. Per precision and batch: prefill ms and tokens/s; decode ms/token
(median and spread over repeats of `--tokens` CUDA-graph replays), tokens/s; weight and KV bytes; the roofline (bytes
a decode step reads / the device-to-device copy bandwidth measured here) and the fraction of it reached; ratios vs
bf16. The timed decode runs the compiled layers (each row says compiled=True); the pipeline's generations and its
speed section run the uncompiled cached decode (the report's speed section says so): --no-compile times that path.

Order (so that a fresh machine's budget is spent on the headline first):
  1. headline  every precision at the first batch, compiled (always), with --check its model check first:
               model     the captured (and compiled) 8B decode vs the uncaptured one (ids) and vs the full forward
                         (logits), and a profile of one uncaptured step (kernels by time)
  2. extra     per precision the other batches (a batch starts only while 90 s of budget are left: skipped, never
               timed uncompiled) and the batch-1 attribution: the decode-attention kernel off and the layers
               uncompiled (no inductor fusion), one switch at a time, in this process
  3. --check   (each part in its own try block; a failure prints its traceback and the rest still runs)
     fp8_kv    the E4M3 cache layer vs fp8_qdq, bit for bit
     int4      the Triton W4A16 kernels (k8 split-K and dense paths, and the export-layout fallback) vs their exact
               arithmetic at the 8B shapes (bf16 and fp16)
     attention the Triton decode-attention kernel vs its reference (bf16 and fp16; windows, soft-capping, E4M3
               cache) and its time at the 8B shape against the grouped sdpa it replaces
     families  every family of the tests' matrix (tests/_builders.py; tiny random models, fp32): the captured decode's
               ids vs the full-sequence re-run, each captured step's logits vs the full forward's
  4. sweep     (--no-sweep skips it) k8 W4A16 configurations per decode shape (CUDA-graph replays over weight copies
               larger than L2), each checked against the exact arithmetic; the fastest valid one per shape makes the
               sweep's table, printed to commit - never installed for the headline, which times the shipped
               (committed) int4.CONFIGS; where the sweep's table differs, int4_awq at batch 1 is timed with it apart
               ("sweep's best", beside the shipped figure)
  5. --check   other formats (FP8 per-channel/per-token, W4A8-AWQ) on a small 2-layer model
Sections are skipped once --budget-s is spent (default 480: a 600 s call on a fresh machine). Every table marks what
is not what its column says: "*" layers uncompiled though compiling was asked (not comparable), "!" compiling failed
(timed uncompiled), "--" not measured; ratios and attribution deltas between such rows are left out ("n/c", with the
reason), and a target whose rows are not comparable says NOT MEASURED.
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
OUT_PATH: list[str] = []  # where main() writes RESULTS: after every section too (a run cut off keeps what it had)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
EXPORTS = {"fp8": "FP8", "fp8_kv": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ",
           "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN", "w4a8_awq": "W4A8_AWQ"}
# where the timed models come from (printed in the header, kept in the JSON): not quantlab's pipeline, not ModelOpt
PROVENANCE = ("quantized by bench/decode.py's own helpers (calibrate: one 128-token forward of the random-weight "
              "bf16 model for static input scales; quantize_linear: round-to-nearest weights from the bf16 weights, "
              "SmoothQuant / AWQ-shaped pre_quant_scales by a closed formula, no AWQ search; export_all: "
              "hf_quant_config.json + safetensors in the layout ModelOpt's HF export writes, producer "
              "'bench/decode.py'), not by quantlab's pipeline nor by ModelOpt; loaded through quantlab's engine loader "
              "(quantlab.engines.torch_engine.load_exported); bf16 is the HF model itself")
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
        finally:
            save_results()
    return wrap


def save_results() -> None:
    """RESULTS as JSON where --out (or $OUT) asks; written after every section and at the end."""
    if OUT_PATH:
        Path(OUT_PATH[0]).parent.mkdir(parents=True, exist_ok=True)
        Path(OUT_PATH[0]).write_text(json.dumps(RESULTS, indent=1, default=str))


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
    """The tests' family matrix (tests/_builders.py's family_configs, which tests/conftest.py re-exports; an older
    tree's conftest._family_configs), read from the file: the bench needs no pytest."""
    for file, name in (("_builders.py", "family_configs"), ("conftest.py", "_family_configs")):
        path = REPO / "tests" / file
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module([], [])
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if fn is not None:
            scope: dict = {}
            exec(compile(ast.Module([fn], []), f"{path.stem}.{name}", "exec"), scope)  # noqa: S102
            return scope[name]()
    raise RuntimeError("tests/_builders.py has no family_configs (nor tests/conftest.py a _family_configs)")


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
        if prec == "fp8_kv" and (weights_dir / "linears.safetensors").is_file():  # fp8's weights (+ the KV scales)
            (out / "linears.safetensors").symlink_to(weights_dir / "linears.safetensors")
        elif prec == "fp8_kv":  # no fp8 export in this run: its weights written here
            save_file({k: v for name, stat in stats.items()
                       for k, v in quantize_linear("fp8", model.get_submodule(name).weight.detach(), stat, name,
                                                   False).items()}, str(out / "linears.safetensors"))
        if prec == "fp8_kv":
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


def bench_precision(prec: str, engine, args, bandwidth: float, reference_rows: dict | None,
                    batches: list[int] | None = None, headline: bool = True) -> dict:
    """One precision's timed rows at `batches` (default: all of --batches). A headline row (the first batch) always
    compiles its layers; an extra row is skipped - not timed uncompiled - once the budget no longer leaves the time
    to compile it, and is recorded so in RESULTS["skipped"] and the tables."""
    model = engine.model
    sizes = model_bytes(model)
    head = engine.head_weights()[0]
    head_bytes = head.numel() * head.element_size() if head.data_ptr() not in {
        p.data_ptr() for p in model.parameters()} else 0
    weights = sizes["weights"] + head_bytes
    read_weights = weights - sizes["embedding"]
    out = {"weights_GB": weights / 1e9, "plan": getattr(engine, "plan", None), "batches": {}, "skipped_batches": {}}
    kernels = (out["plan"] or {}).get("kernels", ["torch (bf16)"])
    if headline:
        say(f"  {prec}: weights {weights / 1e9:.2f} GB ({read_weights / 1e9:.2f} GB read per decode step); "
            f"kernels: {'; '.join(kernels)}")
    context = args.context
    for batch in (args.batches if batches is None else batches):
        why = None if headline else extra_row_skip(elapsed(), args.budget_s, args.compile)
        if why:
            RESULTS["skipped"].append(f"{prec} batch {batch} ({why})")
            out["skipped_batches"][batch] = why
            say(f"  SKIP {prec} batch {batch}: {why}")
            continue
        row = {}
        prompts = torch.randint(0, model.config.vocab_size, (batch, context),
                                generator=torch.Generator().manual_seed(batch)).to(DEVICE)
        dec = decode.Decoder(model, engine.head, engine.captured.take, batch, context + args.tokens + 2,
                             capture=DEVICE == "cuda", compile=args.compile)
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
                # profiles after rows: one runs only while PROFILE_HEADROOM_S are left for the rows after it
                if (args.profile and batch == max(args.prefill_batches)
                        and elapsed() < args.budget_s - PROFILE_HEADROOM_S):
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
            if batch == args.batches[0] and args.profile and elapsed() < args.budget_s - 60:  # ~1 s
                try:
                    row["profile"] = profile_step(dec)
                except Exception:  # noqa: BLE001
                    row["profile"] = {"error": traceback.format_exc()[-1500:]}
            if reference_rows and batch in reference_rows:
                row.update(vs_bf16(row, reference_rows[batch], args.compile))
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
            + (f" (NOT COMPARABLE: {row['vs_bf16_not_comparable']})" if row.get("vs_bf16_not_comparable") else "")
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


SWEEP_TABLE: dict = {}  # the sweep's table where it differs from the shipped int4.CONFIGS (int4_sweep fills it)
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


def _sweep_shape(rows: int, n: int, k: int, g, bandwidth: float, deadline: float, picks: dict) -> dict:
    """One decode shape's sweep; its best valid configuration goes into `picks` where it beats the shipped one
    (int4.CONFIGS itself is left as shipped: the headline rows time the committed table)."""
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
        picks[(int4.m_bucket(rows), n, k)] = out["best_config"]
    return out


def int4_sweep(bandwidth: float, deadline: float) -> dict:
    """k8 W4A16 configurations at the 8B decode shapes (q|k|v and gate|up fused widths), each checked for exactness
    and timed from CUDA-graph replays over weight copies larger than L2; the fastest valid one per shape (where it
    beats the shipped int4.CONFIGS entry, "shipped" below) makes the sweep's table, printed to commit and kept in
    the results - never installed for this run's headline rows, which time the shipped table (sweep_timed times
    int4_awq at batch 1 with the sweep's table, apart). bf16 (cuBLAS), FP8 (torch._scaled_mm) and the previous int4
    kernels (export layout) at the same shapes for comparison."""
    from quantlab.engines.kernels import int4

    if not int4.k8_usable("cuda", torch.bfloat16):
        say("  k8 kernels failed their startup check: the engine runs the export-layout kernels; no sweep")
        return {"k8_usable": False}
    out, picks = {}, {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 16):
        for n, k in SWEEP_SHAPES:
            key = f"M{rows}_N{n}_K{k}"
            r = out[key] = _sweep_shape(rows, n, k, g, bandwidth, deadline, picks)
            say(f"  {key:18s} bf16 {r['bf16_us']:6.1f}us fp8 {r['fp8_us']:6.1f}us | int4 export "
                f"{r['export_us']:6.1f}us "
                f"k8 shipped {r['k8_default_us']:6.1f}us sweep's best {r['best_us']:6.1f}us = "
                f"{r['best_GBps']:.0f} GB/s "
                f"({100 * r['best_fraction_of_copy']:.0f}% of copy) {r['best_config']}")
            failed = [c for c in r["all"] if "error" in c]
            if failed:
                say(f"    {len(failed)} configurations skipped, e.g. {failed[0]}")
            empty_cache()
    table = dict(sorted({**int4.CONFIGS, **picks}.items()))
    changed = sorted(key for key, cfg in picks.items() if int4.CONFIGS.get(key) != cfg)
    say("  the sweep's int4.CONFIGS for this GPU (to commit into quantlab/engines/kernels/int4/configs.py; NOT "
        "used by this run's headline rows, which time the shipped table); entries that differ from the shipped: "
        + (", ".join(map(str, changed)) or "none"))
    print("CONFIGS = {\n" + "".join(f"    {key}: {cfg},\n" for key, cfg in table.items()) + "}", flush=True)
    out["configs"] = {str(key): cfg for key, cfg in table.items()}
    out["differs_from_shipped"] = [str(key) for key in changed]
    SWEEP_TABLE.clear()
    if changed:  # the table sweep_timed times int4_awq with (nothing to time where it is the shipped one)
        SWEEP_TABLE.update(table)
    return out


# ------------------------------------------------------------------------------------------------ marks
# Every table marks a figure that is not what its column says: "*" layers not compiled although compiling was asked
# (the budget: not comparable), "!" compiling failed (timed uncompiled: the engine's own result), "-" not measured;
# a ratio or delta between rows of which one is "*" or "-" is left out ("n/c"), with the reason in the JSON.
PROFILE_HEADROOM_S = 150.0  # a prefill profile (~8 s) runs only while this much budget is left for the rows after it
COMPILE_HEADROOM_S = 90.0  # an extra row (after the headline) starts only while this much is left: compiled, or not
MARKS = {"*": "layers not compiled although compiling was asked (the budget ran out): not comparable",
         "!": "compiling the layers failed (compile_error in the row): timed uncompiled, the engine's own result",
         "-": "not measured (skipped for the budget, or the section failed: see 'skipped' / 'errors')"}


def extra_row_skip(elapsed_s: float, budget_s: float, compile_requested: bool) -> str | None:
    """Why an extra row (a batch after the headline one) is not started, or None: it is skipped rather than timed
    uncompiled once the budget no longer leaves COMPILE_HEADROOM_S to compile and time it."""
    left = budget_s - elapsed_s
    if left < 20:
        return f"budget: {left:.0f}s left"
    if compile_requested and left < COMPILE_HEADROOM_S:
        return f"budget: {left:.0f}s left, too little to compile the layers (it would run uncompiled)"
    return None


def row_mark(row: dict | None, compile_requested: bool) -> tuple[str, str | None]:
    """The mark of one timed row (decode and prefill alike: the prefill runs the same layers) and why: "" (timed as
    asked), "!" , "*" or "-" (MARKS)."""
    if not row or row.get("decode_ms_per_token") is None:
        return "-", MARKS["-"]
    if row.get("compile_error"):
        return "!", MARKS["!"]
    if compile_requested and row.get("compiled") is False:
        return "*", MARKS["*"]
    return "", None


def comparable(rows: list[dict | None], compile_requested: bool) -> str | None:
    """None where every row may be compared with the others, else why not (the first bad row's mark)."""
    for row in rows:
        mark, why = row_mark(row, compile_requested)
        if mark in ("*", "-"):
            return why
    return None


def vs_bf16(row: dict, ref: dict | None, compile_requested: bool) -> dict:
    """A row's decode and prefill speedups against the bf16 row of its batch, only where both rows are comparable
    (else vs_bf16_not_comparable says why and no speedup is given)."""
    why = comparable([row, ref], compile_requested)
    if why:
        return {"vs_bf16_not_comparable": why}
    out = {"vs_bf16_not_comparable": None, "decode_speedup_vs_bf16": ref["decode_ms_per_token"]
           / row["decode_ms_per_token"]}
    if ref.get("prefill_ms") and row.get("prefill_ms"):
        out["prefill_speedup_vs_bf16"] = ref["prefill_ms"] / row["prefill_ms"]
    return out


def attribution_delta(out: dict, variant: dict) -> tuple[float | None, str | None]:
    """(variant ms - default ms, None), or (None, why the delta is left out): the default row must have run as asked
    (compiled where compiling was asked) and the variant as the attribution says (compiled unless it is the
    uncompiled switch); a delta between a compiled and an uncompiled row is otherwise no attribution."""
    if out.get("default_ms") is None:
        return None, "the default row was not measured"
    if out.get("default_compile_error"):
        return None, "the default row's compile failed (timed uncompiled)"
    if out.get("compile_requested") and out.get("default_compiled") is False:
        return None, "the default row ran uncompiled (budget)"
    if "ms" not in variant:
        return None, "this variant failed"
    if variant.get("compiled") != variant.get("expected_compiled"):
        return None, (f"this variant ran {'compiled' if variant.get('compiled') else 'uncompiled'}, the attribution "
                      f"asks {'compiled' if variant.get('expected_compiled') else 'uncompiled'}")
    return variant["ms"] - out["default_ms"], None


def attribution_cells(out: dict) -> list[str]:
    """The default cell and one per ATTRIBUTION variant: ms (and the delta where attribution_delta gives one; "n/c"
    with a mark where it does not)."""
    default = out.get("default_ms")
    mark = ("!" if out.get("default_compile_error") else
            "*" if out.get("compile_requested") and out.get("default_compiled") is False else "")
    cells = [f"{default:.3f}{mark}" if default is not None else "-- (not measured)"]
    for name, _, _ in ATTRIBUTION:
        r = out.get(name) or {}
        if "ms" not in r:
            cells.append("FAILED" if "error" in r else "--")
            continue
        delta, why = attribution_delta(out, r)
        cells.append(f"{r['ms']:.3f} ({delta:+.3f})" if delta is not None else f"{r['ms']:.3f} (n/c: {why})")
    return cells


def _decode_cell(row: dict | None, ref: dict | None, bf16: bool, compile_requested: bool) -> tuple[str, str]:
    """One batch's cell of the decode table and its mark."""
    mark, _ = row_mark(row, compile_requested)
    if mark == "-":
        return "|     --  (not measured)  ", mark
    x = "  1.00" if bf16 and not mark else ("   n/c" if comparable([row, ref], compile_requested)
                                            else f" {ref['decode_ms_per_token'] / row['decode_ms_per_token']:5.2f}")
    return f"| {row['decode_ms_per_token']:8.3f}{mark or ' '}{x} {100 * row['roofline_fraction']:4.0f}  ", mark


def _prefill_cell(row: dict | None, ref: dict | None, bf16: bool, compile_requested: bool) -> str:
    if not row or not row.get("prefill_ms"):
        return "--"
    mark, _ = row_mark(row, compile_requested)
    if comparable([row, ref], compile_requested):
        return f"n/c{mark}"
    return ("1.00" if bf16 else f"{ref['prefill_ms'] / row['prefill_ms']:.2f}") + mark


def decode_table(rows: dict, batches: list[int], prefill_batches: list[int], compile_requested: bool) -> list[str]:
    """The summary's table (rows: precision -> batch -> timed row; bf16 the reference): decode ms/token, speedup vs
    bf16 and share of the roofline per batch, prefill speedups; every cell marked (MARKS), ratios of rows that are
    not comparable left out ("n/c"); the footnotes of the marks used."""
    lines = [("precision " + "".join(f"| B={b:<3d} ms/tok   x     %  " for b in batches)
              + f"| prefill x vs bf16 (B={','.join(map(str, prefill_batches))})")]
    ref_rows, used = rows.get("bf16", {}), set()
    for p, by_batch in rows.items():
        cells = ""
        for b in batches:
            cell, mark = _decode_cell(by_batch.get(b), ref_rows.get(b), p == "bf16", compile_requested)
            cells += cell
            used.add(mark)
        pre = []
        for b in prefill_batches:
            pre.append(_prefill_cell(by_batch.get(b), ref_rows.get(b), p == "bf16", compile_requested))
            used.update(m for m in "*!" if pre[-1].endswith(m))
        lines.append(f"{p:9s} {cells}| {' '.join(pre)}")
    lines += [f"  {m} {MARKS[m]}" for m in "*!-" if m in used]
    if any("n/c" in line for line in lines[1:]):
        lines.append("  n/c: a ratio between rows of which one is starred or not measured: left out")
    return lines


def target_line(name: str, value: float | None, goal: float, parts: list[dict | None],
                compile_requested: bool) -> tuple[dict, str]:
    """A target's JSON entry and printed line: MET / MISS from comparable rows only, else NOT MEASURED and why (no
    figure of a row that is not what the target asks)."""
    why = comparable(parts, compile_requested)
    if why or value is None:
        why = ("a row it needs ran uncompiled (budget): not comparable" if why == MARKS["*"] else
               "a row it needs was not measured (skipped or failed: see 'skipped' / 'errors')")
        return {"value": None, "met": None, "not_measured": why}, f"  target {name:36s} NOT MEASURED ({why})"
    met = value >= goal
    return {"value": value, "met": met}, f"  target {name:36s} {'MET ' if met else 'MISS'} ({value:.2f})"


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


def attribution(prec: str, engine, args, base: dict | None) -> dict:
    """Batch 1 with one switch off at a time (decode.FEATURES, layer compilation), against the timed default row
    (`base`, the headline row of this precision); a delta only where both sides ran as the table says
    (attribution_delta), else the reason it is left out."""
    base = base or {}
    out = {"default_ms": base.get("decode_ms_per_token"), "default_compiled": base.get("compiled"),
           "default_compile_error": base.get("compile_error"), "compile_requested": args.compile}
    for name, features, compile_layers in ATTRIBUTION:
        saved = dict(decode.FEATURES)
        decode.FEATURES.update(features)
        try:
            ms, info = _decode_ms(engine, args, compile_layers and args.compile)
            out[name] = {"ms": ms, "attention": info["attention"], "compiled": info["compiled"],
                         "expected_compiled": compile_layers and args.compile}
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()[-1500:]}
        finally:
            decode.FEATURES.clear()
            decode.FEATURES.update(saved)
            torch._dynamo.reset()
            decode._COMPILED.clear()
    for name, _, _ in ATTRIBUTION:
        out[name]["delta_ms"], out[name]["delta_left_out"] = attribution_delta(out, out[name])
    cells = attribution_cells(out)
    say(f"  attribution {prec} B=1: default {cells[0]} ms; "
        + "; ".join(f"{name} {cell}" for (name, _, _), cell in zip(ATTRIBUTION, cells[1:], strict=True)))
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
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="stop starting sections after this (fits a 600 s call on a fresh machine; the headline "
                        "rows come first and always compile, a later batch starts only while 90 s are left)")
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
        section("check_int4_kernels", 50, budget)(check_int4)
        section("check_attention", 15, budget)(check_attention)
    section("check_families", 20, budget)(check_families)
    if args.compile:
        section("check_compiled_tiny", 15, budget)(check_compiled_tiny)


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


def _reset_compiled() -> None:
    torch._dynamo.reset()
    decode._COMPILED.clear()
    empty_cache()


def bench_headline(prec: str, engine, args, bandwidth: float, reference_rows: dict) -> dict:
    """The headline of one precision: the checks of its model (--check) and its first batch, compiled."""
    out = {}
    if args.check:
        try:
            out["check"] = check_model(prec, engine, args)
        except Exception:  # noqa: BLE001
            out["check"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            say(f"  check {prec} FAILED\n{out['check']['error']}")
    out.update(bench_precision(prec, engine, args, bandwidth, reference_rows, args.batches[:1], headline=True))
    return out


def bench_more(prec: str, engine, args, bandwidth: float, reference_rows: dict) -> dict:
    """The rest of one precision: the batches after the first (each skipped, not timed uncompiled, once the budget is
    short) and the batch-1 attribution against the headline row."""
    out = bench_precision(prec, engine, args, bandwidth, reference_rows, args.batches[1:], headline=False)
    if args.attribution and prec in args.attribution_precisions:
        if elapsed() < args.budget_s - 40:
            base = RESULTS["sections"][f"bench_{prec}"]["batches"].get(1)  # the attribution times batch 1
            out["attribution"] = attribution(prec, engine, args, base)
        else:
            RESULTS["skipped"].append(f"attribution {prec} (budget)")
    return out


def _merge_more(prec: str, res: dict | None, args) -> None:
    """The extra pass's rows into the precision's section (the JSON keeps one bench_<precision> entry)."""
    main_res = RESULTS["sections"][f"bench_{prec}"]
    RESULTS["sections"].pop(f"bench_{prec}_more", None)
    if res is None:  # the section was skipped or failed: every extra row says so
        for b in args.batches[1:]:
            main_res["skipped_batches"].setdefault(b, "the extra pass was skipped (budget) or failed")
        return
    main_res["batches"].update(res["batches"])
    main_res["skipped_batches"].update(res["skipped_batches"])
    if "attribution" in res:
        main_res["attribution"] = res["attribution"]


def bench_all(args, shape: dict, precisions: list[str], bandwidth: float, budget: float) -> tuple[dict, Path | None]:
    """The headline pass (every precision at its first batch, compiled, with its model check), then the extra pass
    (the other batches and the attribution, skipped first when the budget runs short). The engines stay loaded
    between the passes. Returns the export directories and their root (removed by the caller)."""
    reference = section("build_bf16", 15, budget)(functools.partial(build_reference, args.layers, shape))
    export_dirs, workroot = export_models(args, reference, precisions, budget)
    reference_rows: dict = {}
    engines = {}
    for prec in precisions:
        if (reference is None) if prec == "bf16" else (prec not in export_dirs):
            RESULTS["skipped"].append(f"bench {prec} (no {'model' if prec == 'bf16' else 'export'})")
            continue

        def headline(prec=prec):  # reference: the enclosing variable (set to None below, so nothing keeps it)
            engines[prec] = engine_for(prec, reference, {k: Path(v) for k, v in export_dirs.items()})
            return bench_headline(prec, engines[prec], args, bandwidth, reference_rows)
        res = section(f"bench_{prec}", 45, budget)(headline)
        _reset_compiled()
        if res and prec == "bf16":
            reference_rows.update(res["batches"])
    reference = None  # the bf16 engine keeps the model until its extra pass is done
    for prec in list(engines):
        engine = engines.pop(prec)
        extra = args.batches[1:] or (args.attribution and prec in args.attribution_precisions)
        if extra and f"bench_{prec}" in RESULTS["sections"]:
            more = functools.partial(bench_more, prec, engine, args, bandwidth, reference_rows)
            _merge_more(prec, section(f"bench_{prec}_more", 30, budget)(more), args)
            if prec == "bf16":
                reference_rows.update(RESULTS["sections"]["bench_bf16"]["batches"])
        if prec != "bf16":
            engine.close()
        del engine
        _reset_compiled()
    return export_dirs, workroot


def sweep_timed(args, export_dirs: dict) -> dict:
    """int4_awq at the first batch with the sweep's table installed (a fresh engine: kernels are chosen at load),
    beside the headline row timed with the shipped int4.CONFIGS; the shipped table is put back after."""
    from quantlab.engines.kernels import int4

    shipped = dict(int4.CONFIGS)
    int4.CONFIGS.update(SWEEP_TABLE)
    try:
        engine = engine_for("int4_awq", None, {"int4_awq": Path(export_dirs["int4_awq"])})
        try:
            ms, info = _decode_ms(engine, args, args.compile)
        finally:
            engine.close()
            del engine
            _reset_compiled()
    finally:
        int4.CONFIGS.clear()
        int4.CONFIGS.update(shipped)
    b1 = 1  # _decode_ms times batch 1
    head = (RESULTS["sections"].get("bench_int4_awq") or {}).get("batches", {}).get(b1)
    ref = (RESULTS["sections"].get("bench_bf16") or {}).get("batches", {}).get(b1)
    row = {"decode_ms_per_token": ms, "compiled": info["compiled"], "compile_error": info["compile_error"],
           "configs": {str(k): v for k, v in SWEEP_TABLE.items()}}
    row.update(vs_bf16(row, ref, args.compile))
    shipped_x = (head or {}).get("decode_speedup_vs_bf16")
    say(f"  int4_awq B={b1} with the sweep's configs: {ms:.3f} ms/token, "
        + (f"x{row['decode_speedup_vs_bf16']:.2f} vs bf16" if "decode_speedup_vs_bf16" in row
           else f"n/c ({row['vs_bf16_not_comparable']})")
        + f"; the headline (shipped configs): {(head or {}).get('decode_ms_per_token') or math.nan:.3f} ms, "
        + (f"x{shipped_x:.2f}" if shipped_x else "n/c") + f"; compiled={info['compiled']}")
    return row


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
    from quantlab.engines.kernels import int4

    RESULTS["args"] = vars(args)
    OUT_PATH[:] = [out_path] if out_path else []
    RESULTS["provenance"] = PROVENANCE
    RESULTS["int4_configs_timed"] = {str(k): v for k, v in sorted(int4.CONFIGS.items())}  # the shipped table
    budget = args.budget_s
    say(f"models: {PROVENANCE}")
    say("order: every precision's headline row (batch 1, compiled) first, then the other batches and the "
        "attribution, then the checks, the W4A16 sweep and the other formats; what the budget skips is listed")

    env = section("environment", 5, budget)(environment) or {}
    bandwidth = env.get("copy_bandwidth_GBps", 4000) * 1e9
    export_dirs, workroot = bench_all(args, shape, precisions, bandwidth, budget)
    RESULTS["int4_configs_timed_are_shipped"] = RESULTS["int4_configs_timed"] == {
        str(k): v for k, v in sorted(int4.CONFIGS.items())}  # nothing changed the table while the rows were timed
    if args.check:
        run_checks(args, budget)
    if args.sweep and DEVICE == "cuda" and "int4_awq" in precisions:
        deadline = time.time() + max(10.0, min(args.sweep_s, budget - elapsed() - 45))
        section("int4_sweep", 45, budget)(functools.partial(int4_sweep, bandwidth, deadline))
        if SWEEP_TABLE and "int4_awq" in export_dirs:
            section("int4_sweep_timed", 35, budget)(functools.partial(sweep_timed, args, export_dirs))
    if workroot is not None:
        shutil.rmtree(workroot, ignore_errors=True)
    if args.check:
        section("check_other_formats", 25, budget)(functools.partial(check_other_formats, args))

    summary(precisions, args)
    if out_path:
        save_results()
        say(f"results -> {out_path}")
    return 0 if not RESULTS["errors"] else 1


def summary_extras(precisions, args) -> None:
    """The batch-1 attribution table (deltas only between rows that ran as the table says) and the W4A16 sweep's
    best kernels per shape beside the shipped ones."""
    names = [name for name, _, _ in ATTRIBUTION]
    rows = {p: (RESULTS["sections"].get(f"bench_{p}") or {}).get("attribution") for p in precisions}
    if any(rows.values()):
        print("  attribution, B=1 decode ms/token (one switch off at a time; (+delta) vs the "
              "default; n/c: no delta, why): precision | default | " + " | ".join(names))
        for p, r in rows.items():
            if r:
                print(f"    {p:9s} | " + " | ".join(attribution_cells(r)))
        missing = [p for p in args.attribution_precisions if p in precisions and not rows.get(p)]
        if args.attribution and missing:
            print(f"    not measured (budget or a failed section): {', '.join(missing)}")
    sweep = RESULTS["sections"].get("int4_sweep") or {}
    for key, r in sweep.items():
        if isinstance(r, dict) and "best_us" in r:
            print(f"  int4 {key:18s} export {r['export_us']:6.1f}us, k8 shipped {r['k8_default_us']:6.1f}us, "
                  f"sweep's best {r['best_us']:6.1f}us ({r['best_GBps']:.0f} GB/s, "
                  f"{100 * r['best_fraction_of_copy']:.0f}% of copy; bf16 {r['bf16_us']:.1f}us, "
                  f"fp8 {r['fp8_us']:.1f}us)")
    if sweep.get("configs"):
        print("  the sweep's table differs from the shipped int4.CONFIGS at: "
              + (", ".join(sweep.get("differs_from_shipped", [])) or "nothing"))
    timed = RESULTS["sections"].get("int4_sweep_timed")
    if timed:
        mark, _ = row_mark(timed, args.compile)
        x = timed.get("decode_speedup_vs_bf16")
        print(f"  int4_awq B=1 with the sweep's best configs (not the headline): "
              f"{timed['decode_ms_per_token']:.3f}{mark} ms/token, " + (f"x{x:.2f} vs bf16" if x else "n/c"))
    if "int4_awq" in precisions:
        print("  INT4 headline rows timed with the shipped int4.CONFIGS: "
              + ("yes" if RESULTS.get("int4_configs_timed_are_shipped") else "NO (the table changed during the run)"))


def summary(precisions, args) -> None:
    """The compact table, and the targets of the issue at batch 1."""
    say("== summary (decode ms/token; x = speedup vs bf16; % = of the measured-bandwidth roofline)")
    rows = {p: (RESULTS["sections"].get(f"bench_{p}") or {}).get("batches", {}) for p in precisions}
    for p, r in rows.items():  # the ratios again from the final rows (bf16's later batches came after some rows)
        for b, row in r.items():
            row["mark"], row["mark_reason"] = row_mark(row, args.compile)  # the JSON's copy of the tables' marks
            if p != "bf16":
                for key in ("decode_speedup_vs_bf16", "prefill_speedup_vs_bf16"):
                    row.pop(key, None)
                row.update(vs_bf16(row, rows.get("bf16", {}).get(b), args.compile))
    for line in decode_table(rows, args.batches, args.prefill_batches, args.compile):
        print(line)
    print(f"  models: {PROVENANCE}")
    b1 = args.batches[0]
    get = lambda p, k, b=b1: rows.get(p, {}).get(b, {}).get(k)  # noqa: E731
    part = lambda p, b=b1: rows.get(p, {}).get(b)  # noqa: E731
    targets = [("bf16 decode >= 50% of roofline", get("bf16", "roofline_fraction"), 0.5, [part("bf16")]),
               ("fp8 decode >= 1.6x bf16", get("fp8", "decode_speedup_vs_bf16"), 1.6, [part("fp8"), part("bf16")]),
               ("int4_awq decode >= 2.5x bf16", get("int4_awq", "decode_speedup_vs_bf16"), 2.5,
                [part("int4_awq"), part("bf16")]),
               ("int8_sq decode >= 1.0x bf16", get("int8_sq", "decode_speedup_vs_bf16"), 1.0,
                [part("int8_sq"), part("bf16")]),
               ("fp8 prefill >= 1.4x bf16 (B=16)", get("fp8", "prefill_speedup_vs_bf16", 16), 1.4,
                [part("fp8", 16), part("bf16", 16)])]
    RESULTS["targets"] = {}
    for name, value, goal, parts in targets:
        RESULTS["targets"][name], line = target_line(name, value, goal, parts, args.compile)
        print(line)
    summary_extras(precisions, args)
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
