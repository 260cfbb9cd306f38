"""Conventions from the model, not from defaults (issue 39): whether windows start with BOS follows the model's
tokenizer, chat template or family, alike for calibration, every evaluation window, the audit's probe and canary and
the generation prompts; recorded in run.json and the report; an explicit choice the model would not expect warns."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST, read_json, run_cli


def _show(res) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"


def _tokenizer(tok_dir: Path, out: Path, post_bos: bool = False, template: str | None = None):
    """The tests' real tokenizer, saved again with a post-processor that puts BOS first and / or a chat template."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    if post_bos:
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B", special_tokens=[(tok.bos_token,
                                                                                          tok.bos_token_id)])
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_the_model_decides_the_prefix(tok_dir, tmp_path):
    """A tokenizer that adds BOS, a chat template that opens with it, a family trained with it: bos; the tests'
    plain tokenizer on a Llama config: none. Each with the evidence it was decided on."""
    from quantlab import conventions

    plain = _tokenizer(tok_dir, tmp_path / "plain")
    assert conventions.expected(plain, {"model_type": "llama"})[0] is None
    adds = _tokenizer(tok_dir, tmp_path / "adds", post_bos=True)
    assert adds("a")["input_ids"][0] == adds.bos_token_id  # the post-processor really adds it
    assert conventions.expected(adds, {"model_type": "llama"}) == ("bos", "its tokenizer adds BOS when it encodes text")
    chat = _tokenizer(tok_dir, tmp_path / "chat", template="{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                                           "{% endfor %}")
    assert conventions.expected(chat, {"model_type": "qwen2"})[0] == "bos"
    token, why = conventions.expected(plain, {"model_type": "gemma3_text"})
    assert token == "bos" and "gemma3_text" in why
    # an explicit choice is kept, and warned about where it is not the model's
    p = conventions.resolve("none", plain, {"model_type": "gemma3_text"}, "eval")
    assert p.token is None and p.source == "explicit" and "expects bos" in p.warning
    assert conventions.resolve("auto", plain, {"model_type": "gemma3_text"}).warning is None
    assert conventions.resolve(None, plain, {"model_type": "llama"}).warning is None  # null: none, as expected


def _stored_tokens(cache: Path) -> dict:
    """role -> the token windows the run's data stage stored (evaluation sets carry documents)."""
    from safetensors.torch import load_file

    out = {}
    for path in cache.rglob("tokens.safetensors"):
        tensors = load_file(str(path))
        out.setdefault("eval" if "docs" in tensors else "calib", []).append(tensors["tokens"])
    return out


def _canaries(cache: Path) -> list[dict]:
    return [json.loads(p.read_text())["canary"] for p in cache.rglob("audit.json")]


def test_gemma_windows_canary_and_prompts_start_with_bos(family_model, tmp_path):
    """A Gemma-3 checkpoint whose tokenizer adds no BOS (as one converted from GGUF): every calibration and
    evaluation window and the canary's windows start with BOS, run.json and the report say so and why."""
    from transformers import AutoTokenizer

    model = family_model("gemma3_text")
    bos = AutoTokenizer.from_pretrained(model).bos_token_id
    cache = tmp_path / "c"
    res = run_cli(["+precision=fp8", f"model.path={model}", *FAST, "hydra.run.dir=outputs/g"], cwd=tmp_path,
                  cache=cache)
    assert res.returncode in (0, 1), _show(res)
    run = tmp_path / "outputs" / "g"
    conv = read_json(run / "run.json")["conventions"]
    assert conv["eval"]["token"] == "bos" and conv["calib"]["token"] == "bos" and conv["warnings"] == []
    assert "gemma3_text" in conv["eval"]["why"]
    tokens = _stored_tokens(cache)
    assert tokens["eval"] and tokens["calib"]
    for windows in tokens["eval"] + tokens["calib"]:
        assert (windows[:, 0] == bos).all() and not (windows[:, 1:] == bos).all()
    canaries = _canaries(cache)
    assert canaries and all(c["prefix"] == "bos" for c in canaries)
    metrics = read_json(run / "metrics.json")
    assert metrics["run"]["eval"]["prefix"]["token"] == "bos"
    assert "starts with the BOS token" in (run / "report.md").read_text()


def test_an_explicit_prefix_the_model_would_not_expect_warns(family_model, tmp_path):
    """eval.prefix_token=none on Gemma-3: kept (the windows are plain text, the canary too), and a warning on the
    console, in run.json and in the verdict's warnings naming the override to drop."""
    model = family_model("gemma3_text")
    cache = tmp_path / "c"
    res = run_cli(["+precision=fp8", f"model.path={model}", *FAST, "eval.prefix_token=none",
                   "hydra.run.dir=outputs/n"], cwd=tmp_path, cache=cache)
    assert res.returncode in (0, 1), _show(res)
    run = tmp_path / "outputs" / "n"
    conv = read_json(run / "run.json")["conventions"]
    assert conv["eval"]["token"] is None and conv["eval"]["source"] == "explicit" and conv["calib"]["token"] == "bos"
    assert len(conv["warnings"]) == 1 and conv["warnings"][0].startswith("eval.prefix_token=none was set")
    assert "eval.prefix_token=auto" in conv["warnings"][0] and "eval.prefix_token=none was set" in res.stdout
    assert any("prefix_token=none" in w for w in read_json(run / "metrics.json")["gate"]["warnings"])
    assert all(c["prefix"] is None for c in _canaries(cache))


@pytest.mark.parametrize("value", ["cls", "BOS-"])
def test_an_unknown_prefix_is_refused_before_compute(tiny_llama, tmp_path, value):
    res = run_cli(["+precision=fp8", f"model.path={tiny_llama}", f"eval.prefix_token={value}"], cwd=tmp_path,
                  cache=tmp_path / "c")
    assert res.returncode == 2 and "auto (what the model expects), bos, eos or none" in res.stderr, _show(res)
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").rglob("tokens.safetensors"))


def _unigram_gemma_tokenizer():
    """A real Unigram tokenizer (what a GGUF Gemma-3 tokenizer is) in transformers' GemmaTokenizer class."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import GemmaTokenizer

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "▁", "▁the", "▁quick", "▁brown", "▁fox", "e", "t", "h", "q", "u",
             "i", "c", "k", "b", "r", "o", "w", "n", "f", "x", "▁=", "a", "l", "y", "▁V", "alk", "."]
    t = Tokenizer(models.Unigram([(w, -float(i)) for i, w in enumerate(words)], unk_id=3, byte_fallback=False))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    t.decoder = decoders.Replace("▁", " ")
    return GemmaTokenizer(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                          pad_token="<pad>")


def test_a_converted_tokenizer_loads_back_encoding_alike(tmp_path):
    """The embedded models' conversion saves the GGUF's tokenizer so that it loads back encoding exactly alike
    (transformers 5 reloads a Unigram GemmaTokenizer as a BPE without merges: one token per character, Gemma-3's
    WikiText-2 perplexity 798 instead of 81 on the same text); the special tokens and BOS id survive."""
    from transformers import AutoTokenizer

    from quantlab.stages.prepare import save_tokenizer

    tok = _unigram_gemma_tokenizer()
    text = " the quick brown fox. = Valkyria"
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(want)[:4] == ["▁the", "▁quick", "▁brown", "▁fox"]
    how = save_tokenizer(tok, tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert back(text, add_special_tokens=False)["input_ids"] == want, how
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (2, 1, 0)
