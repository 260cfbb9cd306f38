"""conventions: what a model expects at the start of every sequence it reads (a BOS token or none), decided from the
model itself, applied alike to calibration, every evaluation window, the audit's probe and canary, and (through the
evaluation windows) the generation prompts.

`prefix_token: auto` (the default of calib.* and eval.*) asks the model, first evidence wins:
1. its tokenizer adds BOS when it encodes text (`add_bos_token`, or a post-processor that puts BOS first: Llama-2/3,
   Mistral, Gemma tokenizers saved by their authors);
2. its chat template starts with the BOS token (a model whose conversations always open with it);
3. its family is trained with BOS before every sequence (Gemma, Gemma 2 and 3: quantlab.families.Family.bos) -
   a tokenizer converted from GGUF carries no add_bos_token, so this is what keeps Gemma on its distribution;
4. otherwise none (SmolLM2, Qwen2: their tokenizers add nothing and their training packs text without a BOS).
bos / eos: that token before seq_len - 1 text tokens of every window (lm-evaluation-harness's rolling-loglikelihood
convention: a prefix token per window, so the first text token is scored too). none (or null): plain text windows.
An explicit choice other than the model's is kept and warned about (a metric measured off the model's input
distribution: Gemma-3 without BOS has ~2.4x the perplexity of Gemma-3 with it on the same tokens).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

AUTO = "auto"
NONE = "none"
CHOICES = (AUTO, "bos", "eos", NONE)


@dataclass(frozen=True)
class Prefix:
    """A resolved prefix: the token name (bos | eos | None), its id, what asked for it and why."""

    token: str | None
    token_id: int | None
    source: str  # auto | explicit
    why: str
    expected: str | None  # what the model itself expects (bos | None)
    expected_why: str
    knob: str = "eval"  # calib | eval | canary

    def describe(self) -> dict:
        """run.json's record of it."""
        return asdict(self)

    @property
    def warning(self) -> str | None:
        """A line for the console and the reports where an explicit choice differs from the model's own."""
        if self.source != "explicit" or self.token == self.expected:
            return None
        want = f"{self.expected} before every window" if self.expected else "no prefix token"
        got = f"{self.token}" if self.token else "none"
        return (f"{self.knob}.prefix_token={got} was set, but this model expects {want} ({self.expected_why}): "
                f"what it reads is measured off the input distribution it was trained on; drop the override "
                f"({self.knob}.prefix_token=auto) unless that is what you serve")


def normalize(value) -> str:
    """auto | bos | eos | none from a config value (null is an explicit none)."""
    return NONE if value is None else str(value).lower()


def expected(tokenizer, config: dict | None) -> tuple[str | None, str]:
    """What the model expects before each sequence (bos or None) and the evidence, in the order of the module doc."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is not None:
        try:
            plain = tokenizer("a", add_special_tokens=False)["input_ids"]
            special = tokenizer("a", add_special_tokens=True)["input_ids"]
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode is refused by the data stage, not here
            plain = special = []
        lead = special[: max(len(special) - len(plain), 0)]
        if bos_id in lead:
            return "bos", "its tokenizer adds BOS when it encodes text"
        template = getattr(tokenizer, "chat_template", None)
        bos = getattr(tokenizer, "bos_token", None)
        if isinstance(template, str) and bos and template.lstrip().startswith(("{{ bos_token }}", "{{bos_token}}",
                                                                               "{{- bos_token }}", bos)):
            return "bos", "its chat template starts every conversation with BOS"
        family = _family(config)
        if family is not None and family.bos:
            return "bos", f"{family.name} models are trained with BOS before every sequence"
    return None, "its tokenizer adds no BOS and its family does not expect one"


def _family(config: dict | None):
    from quantlab.families import FAMILIES

    if not config:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for model_type in (config.get("model_type"), text.get("model_type")):
        if model_type in FAMILIES:
            return FAMILIES[model_type]
    return None


def resolve(value, tokenizer, config: dict | None, knob: str = "eval") -> Prefix:
    """The prefix a data recipe's prefix_token means for this model; an explicit token the tokenizer lacks is
    exit 2 naming the fix."""
    from quantlab.errors import QuantlabError

    choice = normalize(value)
    want, want_why = expected(tokenizer, config)
    if choice == AUTO:
        token, source, why = want, AUTO, want_why
    elif choice == NONE:
        token, source, why = None, "explicit", f"{knob}.prefix_token=none"
    else:
        token, source, why = choice, "explicit", f"{knob}.prefix_token={choice}"
    token_id = None
    if token is not None:
        token_id = getattr(tokenizer, f"{token}_token_id", None)
        if token_id is None:
            raise QuantlabError(f"{knob}.prefix_token={token}: the tokenizer has no {token} token",
                                fix=f"use {knob}.prefix_token={'bos' if token == 'eos' else 'eos'} or none")
        token_id = int(token_id)
    return Prefix(token, token_id, source, why, want, want_why, knob)
