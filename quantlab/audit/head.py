"""head: the input embedding and the output head, on the tensors alone. An embedding stored as quantized codes (no
engine dequantizes an embedding table of a ModelOpt checkpoint); an output head stored quantized where config.json
ties it to the embedding (no Linear the coverage check could see); and a tied model that stores a head copy of
another dtype or other values than its embedding (engines that tie run the embedding, engines that read the copy run
it: two models)."""
from __future__ import annotations

from quantlab.audit.report import ERROR, INFO
from quantlab.audit.state import AuditState
from quantlab.checkpoint import QUANTIZED_DTYPES

SCALES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
HEAD_NAMES = ("lm_head", "embed_out", "output_layer", "output")


def check_head(a: AuditState) -> None:
    """Quantized embeddings, a quantized head outside the Linears config.json implies, a tied head's stored copy."""
    lay = a.layout
    for emb in sorted(lay.embeddings):
        dtype = a.t.dtype_of(f"{emb}.weight")
        scales = [f"{emb}.{s}" for s in SCALES if f"{emb}.{s}" in a.t]
        if dtype in QUANTIZED_DTYPES or scales:
            a.add(ERROR, "head", [emb], f"the input embedding {emb} is stored quantized ({dtype} codes"
                  + (f", with {', '.join(s.rpartition('.')[2] for s in scales)}" if scales else "") + ")",
                  "a recipe pattern matched the embedding (an Embedding quantizer left enabled, a '*' pattern), or "
                  "a tool cast the table to the checkpoint's quantized dtype",
                  consequence="vLLM, SGLang and TensorRT-LLM load a ModelOpt checkpoint's embedding as a float "
                  "table: the codes are read as values (off by the missing scale) or the load fails on the dtype; "
                  "every token starts from a wrong vector",
                  fix="keep the embedding in the model's dtype: exclude it from quantization (ModelOpt's recipes "
                  "do) and re-export")
    if not lay.tie_word_embeddings or (lay.head is not None and f"{lay.head}.weight" in lay.expected):
        return
    heads = [n for n in (f"{h}.weight" for h in HEAD_NAMES) if n in a.t]
    embedding = next((f"{e}.weight" for e in sorted(lay.embeddings) if f"{e}.weight" in a.t), None)
    for head in heads:
        _tied_copy(a, head, embedding)


def _tied_copy(a: AuditState, head: str, embedding: str | None) -> None:
    """A tied model's stored head: quantized, or a copy of another dtype / other values than the embedding."""
    import torch

    module = head.rpartition(".")[0]
    dtype = a.t.dtype_of(head)
    served_by = ("vLLM and transformers tie the head to the embedding and skip the stored copy; TensorRT-LLM's "
                 "and llama.cpp's converters and MLX read lm_head.weight when it is present: the engines run "
                 "different output heads")
    if dtype in QUANTIZED_DTYPES:
        a.add(ERROR, "head", [module], f"config.json ties the output head to the embedding, yet the export stores "
              f"{head} quantized ({dtype} codes)", "the head was untied and quantized (a recipe pattern matched "
              "lm_head) while config.json kept tie_word_embeddings=true",
              consequence=served_by + "; where the copy is read, its codes meet a float head layer",
              fix="drop the stored head (the model is tied) or set tie_word_embeddings=false and keep the head "
              "in high precision; re-export")
        return
    if embedding is None:
        return
    emb = a.t.get(embedding)
    ours = a.t.get(head)
    if tuple(ours.shape) != tuple(emb.shape):
        drift = f"shape {list(ours.shape)} vs the embedding's {list(emb.shape)}"
    elif ours.dtype != emb.dtype:
        drift = f"dtype {str(ours.dtype).removeprefix('torch.')} vs the embedding's " \
                f"{str(emb.dtype).removeprefix('torch.')}"
    elif not torch.equal(ours, emb):
        x, y = emb.float().reshape(-1), ours.float().reshape(-1)
        drift = f"other values (relative difference {float((x - y).norm() / x.norm().clamp_min(1e-30)):.3g})"
    else:
        a.add(INFO, "head", [module], f"the tied model stores {head}, a byte-identical copy of {embedding} "
              "(engines that tie skip it)")
        return
    a.add(ERROR, "head", [module], f"config.json ties the output head to the embedding, yet the stored {head} "
          f"has {drift}", "the copy was written from another tensor than the embedding (a cast, an edit, a "
          "checkpoint merge) while tie_word_embeddings stayed true", consequence=served_by,
          fix="delete the stored head (the tie makes it redundant) or, if the head is meant to differ, set "
          "tie_word_embeddings=false; re-export")
