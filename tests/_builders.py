"""The tests' tiny models and tokenizer, built the same to the bit on every x86 CPU.

A tiny model trained for a second in float32 comes out different on every instruction set (the vectorized random
normal, softmax and matrix products round differently; 120 AdamW steps amplify an ulp into weights 10-40% apart on
two settings of one machine), and the decisions the tests check (an audit bound, a gate at its threshold) moved with
it. So every builder runs in a child process whose arithmetic is pinned: ATen's scalar kernels
(ATEN_CPU_CAPABILITY=default), MKL's conditional numerical reproducibility (MKL_CBWR=COMPATIBLE) and one thread.
tests/test_reliability.py checks that two instruction-set settings build identical bytes.

`python tests/_builders.py NAME OUT [ARGS]` builds one (conftest.pinned does it); the text is the packaged pydoc
topics (quantlab.stages.data.pydoc_topics), the same under every Python.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PINNED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}


def pinned(name: str, out: Path, *args: str, env_extra: dict | None = None) -> Path:
    """Run builder NAME(out, *args) in a child process with the pinned arithmetic (env_extra on top: the tests that
    emulate another instruction set); out."""
    env = {**os.environ, **PINNED_ENV, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    res = subprocess.run([sys.executable, str(Path(__file__)), name, str(out), *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"building {name} {out} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return out


def _topics() -> dict[str, str]:
    from quantlab.stages.data import pydoc_topics

    return pydoc_topics()


def train_tokenizer(out: Path) -> None:
    topics = _topics()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [topics[k] for k in sorted(topics)[:60]]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)


def train(model, tok_dir: Path, steps: int = 120) -> None:
    """A few hundred ms of AdamW on pydoc text: a random model is near-uniform, a trained one is peaked like
    a real LM, which is what quantization error should be measured on."""
    topics = _topics()

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = torch.tensor(tok("\n\n".join(topics[k] for k in sorted(topics)[:80]))["input_ids"])
    windows = ids[: len(ids) // 64 * 64].view(-1, 64)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = windows[torch.randint(len(windows), (16,), generator=gen)]
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def save_model(out: Path, family: str, tok_dir: Path, **dims) -> Path:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=512, hidden_size=dims.get("hidden", 128), intermediate_size=dims.get("inter", 256),
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(vocab_size=512, hidden_size=dims.get("hidden", 64), intermediate_size=dims.get("inter", 192),
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    train(model, tok_dir)
    model.save_pretrained(out, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return out


def family_configs() -> dict:
    """Tiny configs of every family in the README's support table (vocab of the test tokenizer)."""
    import transformers as tf

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(base, tie_word_embeddings=False)),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(base, sliding_window=16)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(base, tie_word_embeddings=True)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(base, head_dim=16)),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(base, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, dict(base, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(base, logits_scaling=4.0, embedding_multiplier=2.0,
                                                                 residual_multiplier=0.5, attention_multiplier=0.25)),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                     dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=256)),
        "opt": (tf.OPTConfig, tf.OPTForCausalLM, dict(vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                      num_attention_heads=4, word_embed_proj_dim=64,
                                                      max_position_embeddings=256)),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(base, head_dim=16)),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                   dict(base, head_dim=16, sliding_window=16, num_hidden_layers=4, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                        dict(base, head_dim=16, sliding_window=16, num_hidden_layers=4, sliding_window_pattern=2,
                             query_pre_attn_scalar=16, final_logit_softcapping=30.0)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                    dict(base, head_dim=16, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                      dict(base, head_dim=16, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1)),
    }


def build_family(name: str, out: Path, tok_dir: Path, steps: int = 60) -> Path:
    """A tiny model of a family, trained briefly on pydoc text, saved by transformers itself (safetensors)."""
    import shutil

    import torch

    config_cls, model_cls, kwargs = family_configs()[name]
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**kwargs))
    model.config.architectures = [model_cls.__name__]
    train(model, tok_dir, steps=steps)
    model.save_pretrained(out, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return out


BUILDERS = {"tokenizer": lambda out: train_tokenizer(out),
            "model": lambda out, family, tok: save_model(out, family, Path(tok)),
            "family": lambda out, name, tok: build_family(name, out, Path(tok))}

if __name__ == "__main__":
    name, out, *rest = sys.argv[1:]
    Path(out).mkdir(parents=True, exist_ok=True)
    BUILDERS[name](Path(out), *rest)
    print(json.dumps({"built": name, "out": out}))
