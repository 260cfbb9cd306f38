"""Cached greedy decoding for every HF causal LM the engines run (the reference, ModelOpt's fake-quant models, the
torch engine's model built from the export): a static, pre-allocated KV cache, one prefill, then one token per step.

How it plugs into transformers without touching a modeling file:
- StaticKV (a transformers Cache) holds one KVLayer per attention module, [batch, kv heads, max_len, head dim],
  allocated at the first write. The positions a forward writes are a tensor the decoder owns (not a counter the
  cache advances), so one captured step replays at any position.
- The model runs under an attention implementation of quantlab's, registered with transformers' AttentionInterface
  and deliberately not with its mask interface: transformers then builds no mask (and asks the cache nothing), and
  quantlab's attention function hands the model's own attention function (sdpa, or the family's eager one with its
  soft-capping and scaling) the mask built once per forward from the positions: causal, and for a layer the model
  gives a sliding window (the `sliding_window` it passes its attention function), that window as transformers
  defines it (key position > query position - window).
- FP8 KV cache (kv_cache_quant_algo=FP8): K (after RoPE) and V are stored in E4M3, quantized on write with the
  exported k_scale / v_scale and dequantized on read: bit for bit the values the full-sequence path's
  quantize-dequantize (fp8_qdq) gives, without re-quantizing the cache every step.
- Decode steps (one token per sequence) run quantlab's Triton decode-attention kernel
  (quantlab.engines.kernels.attention) where it applies (FEATURES["attention_kernel"], the kernel passed its check on
  the device, the module's attention is sdpa or the eager function of a family it was tested on, and the call passes
  nothing it does not implement): it reads the stored cache (E4M3 bytes too) up to the step's position tensor,
  with the module's sliding window and soft-capping, so those steps build no mask and dequantize no cache. Other
  modules and calls use the model's own attention function as above.
- On CUDA the decode step (embedding, every layer, final norm, head, argmax, the next token and position written
  back into the step's own inputs) is captured in one CUDA graph and replayed once per token. With compile=True the
  decoder layers are compiled first (torch.compile, one compiled function per layer class: each layer is handed its
  own KVLayer in place of the shared cache, so nothing per layer is specialized and 32 layers compile once; the
  prefill runs through the same compiled layers, compiled for the prompt's shape, uncaptured), and with them the
  step's ops outside the layers (the final norm and rotary embedding: edge_modules; the argmax and the step's writes:
  advance; engine.kernels.compile_edges), with inductor's horizontal fusion (engine.kernels.combo_kernels), the
  residual add of a one-row INT4 down projection in its kernel (quantlab.engines.fusion; int4_residual_epilogue) and,
  on compute capability 9.0+, programmatic dependent launch (engine.kernels.pdl, read through
  kernels.device.current()): each compiled kernel, the INT4 kernels and the decode-attention kernel
  start while the previous kernel ends and wait for it before they touch its output. The argmax is two passes
  (first_argmax): one reduction over the vocabulary runs in one CUDA block. Models whose step cannot be captured run
  the same cached steps uncaptured: mixture-of-experts blocks (the expert loop reads the routing on the host) and
  models spread over several devices.
"""
from __future__ import annotations

import functools
import logging
import sys
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger("quantlab")
DECODE_ATTN = "quantlab_decode_{}"  # per mask kind: sdpa (boolean masks) or eager (additive masks)
FP8_KV_PREFIX = "quantlab_fp8_kv_"  # torch_engine.ATTN_NAME: the full-sequence FP8 KV attention
CAPTURE_WARMUPS = 2  # eager runs of the step before capture (compilation, cuBLAS handles, allocator)
RECOMPILE_LIMIT = 64  # compiled variants one layer class may hold (layer kinds x batch shapes x models per process)
COMPILE_BACKEND = "inductor"  # tests trace with "eager" (dynamo alone: same graphs and guards, no code generation)
FEATURES = {"attention_kernel": True}  # read by each Decoder at construction (bench/decode.py switches them off)
# families whose eager attention function is softmax(scaling * q k^T, soft-capped, masked) v and nothing else (the
# decode-attention kernel stands in for it); sdpa's is that by definition
KERNEL_EAGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "granite", "gemma", "gemma2", "gemma3",
                         "mixtral", "qwen3_moe", "gpt_neox", "opt")


class Unsupported(Exception):
    """The cached path does not apply to this model; the message says why (the caller falls back)."""


# ------------------------------------------------------------------------------------------------ the cache
class KVLayer:
    """One attention module's K/V: [batch, kv heads, max_len, head dim] in the compute dtype, or E4M3 (stored as
    uint8) with the exported per-tensor scales. `update` writes the positions the cache says and returns what
    attention reads: the first `read_length` positions (dequantized for FP8)."""

    is_sliding = False  # a window is applied by the mask; every layer keeps all max_len positions
    is_compileable = True
    supports_early_init = False

    def __init__(self, cache: StaticKV, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        self.cache = cache
        self.keys = self.values = None
        self.is_initialized = False
        self.kernel = False  # its module's decode steps run the decode-attention kernel (reads the stores as held)
        self.fp8 = k_scale is not None
        if self.fp8:
            self.k_scale, self.v_scale = k_scale.float().reshape(()), v_scale.float().reshape(())
            self.k_inv, self.v_inv = 1.0 / self.k_scale, 1.0 / self.v_scale  # as fp8_qdq computes them

    def _allocate(self, states: torch.Tensor) -> torch.Tensor:
        b, h, _, d = states.shape
        return torch.zeros(b, h, self.cache.max_len, d, device=states.device,
                           dtype=torch.uint8 if self.fp8 else states.dtype)

    def _write(self, store: torch.Tensor, states: torch.Tensor, inv: torch.Tensor | None) -> None:
        pos = self.cache.positions
        if pos.device != states.device:
            pos = pos.to(states.device)
        if inv is not None:
            from quantlab.engines.qlayers import fp8_quantize

            flat = fp8_quantize(states.reshape(-1, states.shape[-1]), inv.to(states.device))
            states = flat.view(torch.uint8).reshape(states.shape)
        store.index_copy_(2, pos, states)

    def _read(self, store: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        held = store[:, :, : self.cache.read_length]
        if scale is None:
            return held
        return (held.view(torch.float8_e4m3fn).float() * scale.to(held.device)).to(dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *_args, **_kwargs):
        """Write this forward's K/V at the cache's positions; return K/V of positions 0..read_length-1 (on a
        kernel step: the stores themselves, E4M3 bytes included, which the kernel reads up to the position)."""
        if self.keys is None:
            self.keys, self.values = self._allocate(key_states), self._allocate(value_states)
            self.is_initialized = True
        self._write(self.keys, key_states, self.k_inv if self.fp8 else None)
        self._write(self.values, value_states, self.v_inv if self.fp8 else None)
        if self.kernel and self.cache.kernel_step:
            return self.keys, self.values
        return (self._read(self.keys, self.k_scale if self.fp8 else None, key_states.dtype),
                self._read(self.values, self.v_scale if self.fp8 else None, value_states.dtype))

    # what transformers may ask a cache layer
    def get_seq_length(self) -> int:
        """Tokens written so far."""
        return self.cache.seen

    def get_max_length(self) -> int:
        """Positions the cache holds."""
        return self.cache.max_len

    def get_mask_sizes(self, _query_length: int, *_args) -> tuple[int, int]:
        """(key length, offset) of the next forward's mask."""
        return self.cache.read_length, 0

    def lazy_initialization(self, key_states, value_states) -> None:
        """Allocate the stores for states of this shape and dtype."""
        self.keys, self.values = self._allocate(key_states), self._allocate(value_states)
        self.is_initialized = True

    def reset(self) -> None:
        """Zero the stores."""
        if self.keys is not None:
            self.keys.zero_()
            self.values.zero_()

    def nbytes(self) -> int:
        """Bytes the stores hold."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


class StaticKV(_cache_base()):
    """The KV cache of one decode: a KVLayer per attention module (indexed by the module's layer_idx), the
    positions the next forward writes (`positions`, a tensor), how many positions attention reads (`read_length`),
    the masks of that forward (`masks`: sliding window -> mask) and the tokens written so far (`seen`)."""

    def __init__(self, num_layers: int, max_len: int, scales: dict[int, tuple] | None = None):
        self.max_len = max_len
        self.positions: torch.Tensor | None = None
        self.read_length = 0
        self.seen = 0
        self.masks: dict = {}
        self.kernel_step = False  # the next forward is a decode step the decode-attention kernel runs
        layers = [KVLayer(self, *(scales or {}).get(i, ())) for i in range(num_layers)]
        try:
            super().__init__(layers=layers)
        except TypeError:  # a transformers whose Cache takes other arguments: the layers are all it needs
            self.layers = layers

    def update(self, key_states, value_states, layer_idx, *_args, **_kwargs):
        """Write layer `layer_idx`'s K/V; return what its attention reads (KVLayer.update)."""
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, _layer_idx: int = 0) -> int:
        """Tokens written so far."""
        return self.seen

    def get_max_length(self, _layer_idx: int | None = None) -> int:
        """Positions the cache holds."""
        return self.max_len

    def get_mask_sizes(self, _query_length: int, _layer_idx: int = 0) -> tuple[int, int]:
        """(key length, offset) of the next forward's mask."""
        return self.read_length, 0

    def get_query_offset(self, _layer_idx: int = 0) -> int:
        """The position of the next forward's first token."""
        return self.seen

    def nbytes(self) -> int:
        """Bytes every layer's stores hold."""
        return sum(layer.nbytes() for layer in self.layers)

    def build_masks(self, windows, kind: str, dtype: torch.dtype) -> None:
        """The masks of the next forward, one per sliding window (None: causal only), [1, 1, T, read_length]:
        boolean for sdpa, additive (0 / dtype min, as transformers' eager masks) for eager attention."""
        q = self.positions
        kv = torch.arange(self.read_length, device=q.device)
        causal = kv[None, :] <= q[:, None]
        masks = {}
        for window in windows:
            allowed = causal if window is None else causal & (kv[None, :] > q[:, None] - window)
            allowed = allowed[None, None]
            if kind == "eager":
                allowed = torch.zeros(allowed.shape, dtype=dtype, device=q.device).masked_fill_(
                    ~allowed, torch.finfo(dtype).min)
            masks[window] = allowed
        self.masks = masks


# ------------------------------------------------------------------------------------------------ attention
SDPA_KWARGS = {"dropout", "scaling", "sliding_window", "is_causal", "position_ids", "use_cache", "cache_position",
               "output_attentions", "output_router_logits"}  # what the grouped path reads or may safely ignore


KERNEL_KWARGS = SDPA_KWARGS | {"softcap"}  # what the decode-attention kernel implements or may safely ignore


def _grouped_sdpa(_module, query, key, value, mask, scaling=None, **_kwargs):
    """sdpa for one query token per sequence with grouped K/V heads, without expanding K/V: the query heads that
    share a K/V head are laid along the query-length axis (q [B, Hkv, G*T, D]), so the cache is read as stored
    (transformers' sdpa path copies it G times per layer and step when a mask is given)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    q = query.reshape(b, hkv, groups * t, d)
    m = mask if t == 1 else mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(1, 1, groups * t, -1)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous(), None


def _kernel_attention(module, query, key, value, window, kwargs):
    """The decode-attention kernel on the stores (key / value: KVLayer.update's return on a kernel step; the op is
    registered by _kernel_usable)."""
    scales = getattr(module, "quantlab_k_scale", None), getattr(module, "quantlab_v_scale", None)
    if key.dtype != torch.uint8:
        scales = (None, None)
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.quantlab.decode_attention(query, key, value, module.quantlab_decode.positions, *scales,
                                              float(scaling), int(window or 0), float(kwargs.get("softcap") or 0.0))
    return out, None


def _stored(module, store: torch.Tensor, scale_name: str, dtype: torch.dtype) -> torch.Tensor:
    """What KVLayer.update returns outside kernel steps, from a store it returned on one (a kernel-step call the
    kernel does not take)."""
    held = store[:, :, : module.quantlab_decode.read_length]
    if store.dtype != torch.uint8:
        return held
    scale = getattr(module, scale_name).float()
    return (held.view(torch.float8_e4m3fn).float() * scale.to(held.device)).to(dtype)


def _decode_attention(module, query, key, value, _attention_mask, **kwargs):
    """The decode-attention kernel on kernel steps (see Decoder); else the model's own attention function with the
    cache's mask for this module's window (for sdpa models and one query token, torch's sdpa on grouped heads: the
    same attention, the cache read once)."""
    cache = module.quantlab_decode
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else module.quantlab_decode_window
    if window != module.quantlab_decode_window:
        cache.window_mismatch.add((module.layer_idx, window, module.quantlab_decode_window))
    if cache.kernel_step and module.quantlab_decode_kernel:
        if set(kwargs) <= KERNEL_KWARGS and not kwargs.get("dropout") and not kwargs.get("output_attentions"):
            if not torch.compiler.is_compiling():
                cache.attention_paths.add("triton decode attention")
            return _kernel_attention(module, query, key, value, window, kwargs)
        key = _stored(module, key, "quantlab_k_scale", query.dtype)
        value = _stored(module, value, "quantlab_v_scale", query.dtype)
    mask = cache.masks.get(window)
    if mask is None:  # a window the model did not declare up front: build it for this call
        saved = cache.masks
        cache.build_masks([window], cache.mask_kind, query.dtype)
        mask, cache.masks = cache.masks[window], saved
    if mask.device != query.device:  # a model spread over devices: masks are built where the positions are
        mask = mask.to(query.device)
    grouped = (cache.mask_kind == "sdpa" and query.shape[2] == 1 and query.shape[1] % key.shape[1] == 0
               and key.shape[1] != query.shape[1] and set(kwargs) <= SDPA_KWARGS and not kwargs.get("dropout"))
    if not torch.compiler.is_compiling():
        cache.attention_paths.add("grouped sdpa" if grouped else cache.base_name)
    if grouped:
        return _grouped_sdpa(module, query, key, value, mask, **kwargs)
    return module.quantlab_decode_base(module, query, key, value, mask, **kwargs)


def _register(kind: str) -> str:
    from transformers import AttentionInterface

    name = DECODE_ATTN.format(kind)
    AttentionInterface.register(name, _decode_attention)  # and no mask function: transformers builds no mask
    return name


def _kernel_takes(base, implementation: str) -> bool:
    """Whether the decode-attention kernel stands in for this attention function (sdpa, or a tested family's
    eager function)."""
    if implementation.removeprefix(FP8_KV_PREFIX) == "sdpa":
        return True
    family = getattr(base, "__module__", "").rpartition(".")[0].rpartition(".")[2]
    return getattr(base, "__name__", "") == "eager_attention_forward" and family in KERNEL_EAGER_FAMILIES


def _kernel_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """FEATURES["attention_kernel"], engine.kernels not disabling decode_attention, and the kernel passed its check
    on this device (Triton runs there)."""
    from quantlab.engines.kernels import attention
    from quantlab.engines.kernels import device as kernel_device

    if not FEATURES.get("attention_kernel") or not kernel_device.allowed("decode_attention"):
        return False
    return kernel_device.available() and attention.usable(str(device), dtype)


def _eager_function(module: nn.Module):
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise Unsupported(f"{type(module).__name__} has no eager attention function")
    return fn


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module: the modules that own a layer_idx and call attention."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]


def layer_window(module: nn.Module, config) -> int | None:
    """The sliding window a module's attention uses (None: full causal), as the modeling file decides it."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    types = getattr(config, "layer_types", None)
    if types and module.layer_idx < len(types) and types[module.layer_idx] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def _decoder_layer_of(model: nn.Module, name: str) -> nn.Module | None:
    """The decoder layer holding the module `name`: its nearest ancestor that is an element of a ModuleList."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return model.get_submodule(".".join(parts[: i + 1]))
    return None


def edge_modules(model: nn.Module, layer: nn.Module | None) -> list[nn.Module]:
    """The step's modules outside the decoder layers that are compiled with them: the leaf children of the module
    holding the layers' list (the final norm, the rotary embedding), embeddings and dropout aside."""
    if layer is None:
        return []
    for parent in model.modules():
        for child in parent.children():
            if isinstance(child, nn.ModuleList) and any(c is layer for c in child):
                return [m for m in parent.children() if m is not child and not list(m.children())
                        and not isinstance(m, (nn.Embedding, nn.Dropout))]
    return []


def is_moe(model: nn.Module) -> bool:
    """Whether the model routes tokens to experts (data-dependent work the host reads: not capturable)."""
    from quantlab.engines.moe import QuantExperts, is_fused_experts

    return any(isinstance(m, QuantExperts) or is_fused_experts(m) or type(m).__name__.endswith(("Experts", "MoeBlock"))
               for m in model.modules())


def _devices(model: nn.Module) -> set:
    return {p.device for p in model.parameters()} | {b.device for b in model.buffers()}


def check_supported(model: nn.Module) -> None:
    """Raise Unsupported (saying why) when the cached path does not apply to this model."""
    modules = attention_modules(model)
    if not modules:
        raise Unsupported(f"{type(model).__name__}: no attention module with a layer_idx")
    indices = sorted(m.layer_idx for _, m in modules)
    if indices != list(range(len(indices))):
        raise Unsupported(f"{type(model).__name__}: attention layer indices {indices[:8]} are not 0..n-1")
    implementation = model.config._attn_implementation or "eager"
    if not (implementation in ("sdpa", "eager") or implementation.startswith(FP8_KV_PREFIX)):
        raise Unsupported(f"attention implementation {implementation} (the cached path wraps sdpa or eager)")


# ------------------------------------------------------------------------------------------------ compiled layers
_COMPILED: dict = {}


def argmax_chunks(vocab: int) -> int:
    """The chunks first_argmax splits a vocabulary into: the most (32-512) that divide it into runs of 64 or more;
    0 where none does (a single argmax)."""
    return next((g for g in range(512, 31, -1) if vocab % g == 0 and vocab // g >= 64), 0)


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of [B, V] in two passes where V splits into 32-512 chunks: the first maximum of each chunk,
    then the first chunk holding the row's maximum (the same index as argmax, ties and NaN included: each pass takes
    the first maximum, NaN counting as the largest). One reduction over 128K values runs in one CUDA block (~28 us
    on an H200); the chunked one fills the GPU."""
    batch, vocab = logits.shape
    chunks = argmax_chunks(vocab)
    if not chunks:
        return logits.argmax(-1)
    parts = logits.reshape(batch, chunks, vocab // chunks)
    inner = parts.argmax(-1)  # [B, G]
    best = parts.gather(-1, inner[..., None])[..., 0].argmax(-1, keepdim=True)  # [B, 1]
    return best[:, 0] * (vocab // chunks) + inner.gather(-1, best)[:, 0]


def _inductor_has(knob: str) -> bool:
    """Whether this torch's inductor has the config knob ("triton.enable_pdl", "combo_kernels")."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return False
    target = inductor_config
    for part in knob.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def _options() -> dict | None:
    """inductor's options for everything the decoder compiles (None for another backend)."""
    if COMPILE_BACKEND != "inductor":
        return None
    from quantlab.engines import fusion
    from quantlab.engines.kernels import device

    ctx = device.current()  # engine.kernels, as the torch engine's build set it
    options = {"emulate_precision_casts": True}
    if ctx.pdl and _inductor_has("triton.enable_pdl"):
        options["triton.enable_pdl"] = True  # on compute capability 9.0+ only (inductor checks)
    # inductor's horizontal fusion of a layer's independent kernels (rotary q, rotary k + cache write, cache write v:
    # one launch; measured: INT4 decode 2.28 -> 2.20 ms a token on the 8B shape)
    if ctx.combo_kernels and _inductor_has("combo_kernels"):
        options["combo_kernels"] = True
    # a one-row INT4 down projection adds the layer's residual as it writes (fusion.ResidualAdd: the add's kernel
    # goes; nothing to rewrite in graphs without one)
    if (ctx.allows("int4_residual_epilogue") and fusion.available
            and _inductor_has("post_grad_custom_post_pass")):
        options["post_grad_custom_post_pass"] = fusion.RESIDUAL_ADD
    return options


def _compiled(fn):
    """One compiled version of a function: a module class's forward (decoder layers, edge_modules; dynamo keys its
    compiled variants by the function's code and guards, so every module of a class and every model of that class
    share it) or advance."""
    if fn not in _COMPILED:
        cfg = torch._dynamo.config
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, knob):
                setattr(cfg, knob, max(getattr(cfg, knob), RECOMPILE_LIMIT))
        _COMPILED[fn] = torch.compile(fn, backend=COMPILE_BACKEND, options=_options())
    return _COMPILED[fn]


def advance(logits: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, pos: torch.Tensor) -> None:
    """The step's last ops: the next token (first_argmax of the float32 logits [B, V]) written to `tokens` and to
    `out` after position pos, and pos moved on by one."""
    nxt = first_argmax(logits)
    tokens.copy_(nxt[:, None])
    out.index_copy_(1, pos + 1, nxt[:, None])
    pos.add_(1)


def _run_compiled(fn, layer: nn.Module, kv: KVLayer, cache: StaticKV, *args, **kwargs):
    """A decoder layer through its compiled forward, handed its own KVLayer in place of the shared cache."""
    args = tuple(kv if a is cache else a for a in args)
    kwargs = {k: kv if v is cache else v for k, v in kwargs.items()}
    return fn(layer, *args, **kwargs)


# ------------------------------------------------------------------------------------------------ the decoder
class Decoder:
    """Greedy decoding of one batch size with a static KV cache of max_len positions.

    model: an HF causal LM whose output embedding may be replaced by a capture; head(hidden [B, 1, H]) -> float32
    logits [B, 1, V]; take_hidden() -> the final hidden states [B, T, H] of the last forward. `prefill` writes the
    prompts' K/V and returns the first new token; `step` writes one token's K/V and produces the next (a CUDA graph
    replay once captured). capture: None = wherever possible (CUDA, one device, no expert routing)."""

    def __init__(self, model: nn.Module, head, take_hidden, batch: int, max_len: int, capture: bool | None = None,
                 compile: bool = False, keep_logits: bool = False):
        check_supported(model)
        self.model, self.head, self.take_hidden = model, head, take_hidden
        self.batch, self.max_len = batch, max_len
        params = next(model.parameters())
        self.device, self.dtype = params.device, params.dtype
        implementation = model.config._attn_implementation or "eager"
        self.mask_kind = implementation.removeprefix(FP8_KV_PREFIX)
        self.attn_name = _register(self.mask_kind)
        modules = attention_modules(model)
        scales = {m.layer_idx: (m.quantlab_k_scale, m.quantlab_v_scale) for _, m in modules
                  if implementation.startswith(FP8_KV_PREFIX) and hasattr(m, "quantlab_k_scale")}
        if implementation.startswith(FP8_KV_PREFIX) and len(scales) != len(modules):
            raise Unsupported("FP8 KV cache: some attention modules have no k_scale / v_scale")
        self.cache = StaticKV(len(modules), max_len, scales)
        self.cache.mask_kind = self.mask_kind
        self.cache.base_name = implementation
        self.cache.window_mismatch = set()
        self.cache.attention_paths = set()
        windows = set()
        single = len(_devices(model)) == 1
        kernel = single and _kernel_usable(self.device, self.dtype)
        for _, module in modules:
            base = (module.quantlab_base_attention if implementation.startswith(FP8_KV_PREFIX)
                    else _eager_function(module) if implementation == "eager" else None)
            if base is None:
                from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

                base = ALL_ATTENTION_FUNCTIONS["sdpa"]
            module.quantlab_decode = self.cache
            module.quantlab_decode_base = base
            module.quantlab_decode_window = layer_window(module, model.config)
            module.quantlab_decode_kernel = kernel and _kernel_takes(base, implementation)
            self.cache.layers[module.layer_idx].kernel = module.quantlab_decode_kernel
            windows.add(module.quantlab_decode_window)
        self.windows = sorted(windows, key=lambda w: -1 if w is None else w)
        self.kernel_modules = sum(m.quantlab_decode_kernel for _, m in modules)
        self.all_kernel = self.kernel_modules == len(modules)
        self.moe = is_moe(model)
        self.capture = (self.device.type == "cuda" and single and not self.moe) if capture is None else capture
        if self.capture and (self.device.type != "cuda" or not single or self.moe):
            raise Unsupported("CUDA graph capture needs one CUDA device and no expert routing")
        self.compile = compile and single and not self.moe
        self.layers = []  # (decoder layer, its KVLayer) for compiled forwards
        for name, module in modules:
            layer = _decoder_layer_of(model, name)
            if layer is not None:
                self.layers.append((layer, self.cache.layers[module.layer_idx]))
        from quantlab.engines.kernels import device

        # compiled with the layers: the final norm and rotary embedding, and the step's argmax and writes (advance)
        self.edges = (edge_modules(model, self.layers[0][0] if self.layers else None)
                      if self.compile and device.current().compile_edges else None)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.out = torch.zeros(batch, max_len + 1, dtype=torch.long, device=self.device)
        self.position = 0  # the host's copy of pos (uncaptured steps size their reads with it)
        self.keep_logits = keep_logits  # each step's float32 logits kept in `logits` (checks, not decoding)
        self.logits: torch.Tensor | None = None
        self.graph = None
        self.capture_error: str | None = None
        self.compile_error: str | None = None

    # ----------------------------------------------------------------------------------- forward passes
    @contextmanager
    def _mode(self, compiled: bool):
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = self.attn_name
        installed = []
        try:
            if compiled:
                for layer, kv in self.layers:
                    layer.forward = functools.partial(_run_compiled, _compiled(type(layer).forward), layer, kv,
                                                      self.cache)
                    installed.append(layer)
                for module in self.edges or ():
                    module.forward = functools.partial(_compiled(type(module).forward), module)
                    installed.append(module)
            yield
        finally:
            config._attn_implementation = previous
            for module in installed:
                del module.forward

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, read_length: int, compiled: bool = False):
        """One forward writing `tokens` at `positions` and reading positions 0..read_length-1 -> the last
        position's float32 logits [B, V]."""
        cache = self.cache
        cache.positions, cache.read_length = positions, read_length
        cache.kernel_step = tokens.shape[1] == 1 and self.kernel_modules > 0
        if cache.kernel_step and self.all_kernel:
            cache.masks = {}  # every module reads the cache through the kernel: no mask
        else:
            cache.build_masks(self.windows, self.mask_kind, self.dtype)
        position_ids = positions[None].expand(tokens.shape[0], -1)
        with self._mode(compiled):
            self.model(input_ids=tokens, position_ids=position_ids, past_key_values=cache, use_cache=True)
        hidden = self.take_hidden()
        return self.head(hidden[:, -1:])[:, -1]

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """Write the prompts' K/V (positions 0..P-1) -> the first new token of each prompt [B]."""
        batch, length = prompts.shape
        if batch != self.batch or length >= self.max_len:
            raise ValueError(f"prompts {tuple(prompts.shape)} do not fit batch {self.batch} / max_len {self.max_len}")
        with torch.no_grad():
            prompts, positions = prompts.to(self.device), torch.arange(length, device=self.device)
            logits = None
            if self.compile:  # the layers compiled for the prompt's shape too (no graph: one run per prompt)
                if any(layer.keys is None for layer in self.cache.layers):
                    # the stores are allocated (from the states' shapes) by one uncompiled token first, so the
                    # compiled prompt graph is the one of a held cache (allocating inside it would compile again
                    # at the next prompt); position 0 is rewritten below
                    self._run(prompts[:, :1], positions[:1], 1)
                try:
                    logits = self._run(prompts, positions, length, True)
                except Exception as exc:  # noqa: BLE001 - a prefill that cannot be compiled runs uncompiled
                    self._compile_failed(exc)
            if logits is None:  # every position 0..P-1 is (re)written: a failed compiled run leaves nothing behind
                logits = self._run(prompts, positions, length)
            nxt = first_argmax(logits)
            self.out[:, length] = nxt
            self.tokens[:, 0] = nxt
            self.pos.fill_(length)
        self.position = self.cache.seen = length
        return nxt

    def _step(self, read_length: int, compiled: bool) -> None:
        logits = self._run(self.tokens, self.pos, read_length, compiled)
        if self.keep_logits:
            if self.logits is None:  # allocated by the first (uncaptured) run: the graph writes into it
                self.logits = torch.empty_like(logits)
            self.logits.copy_(logits)
        step_end = _compiled(advance) if compiled and self.edges is not None else advance
        step_end(logits, self.tokens, self.out, self.pos)

    def step(self) -> None:
        """Feed the last token, produce the next (written to `tokens` and `out`)."""
        if self.position + 1 >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions")
        with torch.no_grad():
            if self.capture and self.graph is None and self.capture_error is None:
                self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step(self.position + 1, False)
        self.position += 1
        self.cache.seen = self.position

    def _capture(self) -> None:
        """Warm the step up eagerly on a side stream (compiling the layers first when asked), then capture it.
        The warm-ups write the very K/V the first real step writes; the step's inputs are restored after each. A
        compilation that fails is dropped (captured uncompiled); a capture that fails leaves the steps uncaptured."""
        tokens, pos = self.tokens.clone(), self.pos.clone()
        for compiled in ([True, False] if self.compile else [False]):
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(CAPTURE_WARMUPS):
                        self._step(self.max_len, compiled)
                        self.tokens.copy_(tokens)
                        self.pos.copy_(pos)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._step(self.max_len, compiled)
                self.graph, self.compile = graph, compiled
                return
            except Exception as exc:  # noqa: BLE001 - what cannot be compiled or captured still runs, uncaptured
                if compiled:
                    self._compile_failed(exc)  # (synchronizes)
                else:
                    self.capture_error = f"{type(exc).__name__}: {str(exc)[:500]}"
                    log.warning("decode: CUDA graph capture failed (%s)", self.capture_error)
                    try:
                        torch.cuda.synchronize(self.device)
                    except Exception:  # noqa: BLE001 - a sticky capture error: the inputs are restored below anyway
                        pass
                self.tokens.copy_(tokens)
                self.pos.copy_(pos)
        self.compile = False

    def _compile_failed(self, exc: Exception) -> None:
        """The compiled layers failed (prefill or step): said once, recorded, and the layers run uncompiled (a step
        graph captured from them is dropped: the next step captures the uncompiled step)."""
        self.compile_error = f"{type(exc).__name__}: {str(exc)[:500]}"
        self.compile = False
        self.graph = None
        log.warning("decode: compiling the layers failed (%s)", self.compile_error)
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a sticky error surfaces on the uncompiled run
                pass

    def generate(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation of equal-length prompts [B, P] -> new ids [B, new_tokens] (on the model's device)."""
        length = prompts.shape[1]
        if new_tokens <= 0:
            return torch.zeros(prompts.shape[0], 0, dtype=torch.long, device=self.device)
        self.prefill(prompts)
        for _ in range(new_tokens - 1):
            self.step()
        return self.out[:, length: length + new_tokens].clone()

    def describe(self) -> dict:
        """What ran: capture, compilation, cache, attention paths (and the errors that turned a part off)."""
        return {"captured": self.graph is not None, "compiled": self.compile, "moe": self.moe,
                "capture_error": self.capture_error, "compile_error": self.compile_error,
                "kv_cache_bytes": self.cache.nbytes(),
                "fp8_kv": any(layer.fp8 for layer in self.cache.layers), "mask": self.mask_kind,
                "windows": [w for w in self.windows if w is not None],
                "attention": sorted(self.cache.attention_paths), "attention_kernel_modules": self.kernel_modules}

    def close(self) -> None:
        """Drop the graph and the cache (and the attention modules' references to it)."""
        self.graph = None
        for _, module in attention_modules(self.model):
            for attr in ("quantlab_decode", "quantlab_decode_base", "quantlab_decode_window", "quantlab_decode_kernel"):
                if hasattr(module, attr):
                    delattr(module, attr)
        self.cache = None


def greedy(model: nn.Module, head, take_hidden, prompts: torch.Tensor, new_tokens: int, capture: bool | None = None,
           compile: bool = False) -> tuple[torch.Tensor, dict]:
    """Cached greedy continuation of equal-length prompts -> (new ids [B, new_tokens], what ran). Raises
    Unsupported when the model cannot use the cache (the caller re-runs full sequences instead)."""
    decoder = Decoder(model, head, take_hidden, prompts.shape[0], prompts.shape[1] + new_tokens, capture, compile)
    try:
        ids = decoder.generate(prompts, new_tokens)
        return ids, decoder.describe()
    finally:
        decoder.close()
