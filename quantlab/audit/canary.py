"""canary: a few windows of held-out text through the exported checkpoint run with deployment numerics and through
the reference; top-1 agreement and mean KL against the bounds of the formats present."""
from __future__ import annotations

import math
import time
from dataclasses import asdict

from quantlab.audit.bounds import canary_bounds
from quantlab.audit.report import ERROR, INFO, WARNING
from quantlab.audit.state import AuditState
from quantlab.errors import QuantlabError


def check_canary(a: AuditState, windows: int, tokens: int) -> None:
    """The logits canary: windows x tokens of held-out text through the export (deployment numerics) and the reference;
    an error or warning outside the bounds of the formats present."""
    import torch

    from quantlab.engines.qlayers import QLAYERS
    from quantlab.engines.torch_engine import load_exported
    from quantlab.gate.metrics import compare_positions
    from quantlab.models import load_model

    algos = a.quant.algos()
    unknown = sorted(algo for algo in algos if algo not in QLAYERS)
    if unknown:
        a.skipped.append(f"canary: engine=torch does not run {', '.join(unknown)}")
        return
    start = time.time()
    if a.probe is not None and a.probe.ids.shape[0] >= windows and a.probe.ids.shape[1] == tokens:
        # the probe ran the reference on these windows already (its first ones: the same text, the same ids)
        ids, ref_logits = a.probe.ids[:windows], a.probe.logits[:windows]
    else:
        ids = canary_ids(a, windows, tokens)
        with torch.no_grad():
            reference = load_model(a.ref, a.device, a.dtype)
            ref_logits = reference(ids.to(a.device.torch), use_cache=False).logits.float().cpu()
            del reference  # one model in memory at a time
    with torch.no_grad():
        try:
            model, _ = load_exported(a.ckpt, a.device, a.dtype)
        except QuantlabError as exc:
            a.add(ERROR, "canary", [], f"the export does not load with deployment numerics: {exc.problem}",
                  "see the tensor findings above", consequence="engines refuse this checkpoint at load",
                  fix="fix the findings above and re-export")
            return
        logits = model(ids.to(a.device.torch), use_cache=False).logits.float().cpu()
        del model
    cmp = compare_positions(ref_logits[:, :-1], logits[:, :-1], ids[:, 1:])
    agree = (cmp["argmax_ref"] == cmp["argmax_cand"]).float()
    finite = bool(torch.isfinite(logits).all())
    kl = cmp["kl"].float()
    top1, kl_mean = float(agree.mean()), float(kl.mean()) if finite else math.inf
    nll_gap = float(cmp["nll_cand"].mean() - cmp["nll_ref"].mean()) if finite else math.inf
    ppl_ratio = math.exp(nll_gap) if nll_gap < 700 else math.inf
    b = canary_bounds(algos)
    a.canary = {"windows": int(ids.shape[0]), "tokens": int(ids.shape[1]), "positions": int(agree.numel()),
                "prefix": a.prefix.token if a.prefix else None,
                   "top1": top1, "kl_mean": _finite(kl_mean), "kl_p99": _finite(float(kl.quantile(0.99))),
                   "ppl_ratio": _finite(ppl_ratio), "finite": finite, "bounds": asdict(b),
                   "seconds": round(time.time() - start, 2)}
    text = (f"top-1 agreement {top1:.3f}, mean KL {kl_mean:.4f} nats, perplexity ratio {ppl_ratio:.3f} over "
            f"{agree.numel()} positions ({ids.shape[0]} x {ids.shape[1]} tokens)")
    if not finite or top1 < b.top1_error or kl_mean > b.kl_error:
        a.add(ERROR, "canary", [], f"the exported checkpoint's logits diverge from the reference: {text}; "
              f"healthy {'/'.join(sorted(algos))} exports stay above top-1 {b.top1_error} and below KL "
              f"{b.kl_error}", "a broken layer the tensor checks cannot see (layers in the wrong order, an "
              "engine-level difference) or one they reported above",
              consequence="served with these numerics the model predicts other tokens than the reference on "
              "ordinary text: quality far below what the format delivers when healthy",
              fix="fix the findings above; if there are none, re-export and compare the fake-quant model with the "
              "export (quantlab eval.attribution=true)")
    elif top1 < b.top1_warn or kl_mean > b.kl_warn:
        a.add(WARNING, "canary", [], f"the exported checkpoint's logits are further from the reference than "
              f"healthy exports of its format: {text} (warn below top-1 {b.top1_warn} / over KL {b.kl_warn})",
              "a format too aggressive for this model, or a partly broken layer",
              consequence="served as is, quality is below healthy exports of this format",
              fix="run the evaluation (the gate decides); compare with another calibration or format")
    else:
        a.add(INFO, "canary", [], f"logits canary: {text}")


def _finite(x: float) -> float | None:
    """A figure for the JSON report: None where it is not finite (the report stays strict JSON)."""
    return x if math.isfinite(x) else None


def canary_ids(a: AuditState, windows: int, tokens: int):
    """The canary's (and the probe's) windows for this audit's reference, with the prefix the model expects."""
    from quantlab.models import load_tokenizer

    tokenizer = load_tokenizer(a.ref)
    if a.prefix is None:
        from quantlab import conventions

        a.prefix = conventions.resolve(a.prefix_token, tokenizer, a.ref.config, "canary")
    return _canary_ids(tokenizer, windows, tokens, a.prefix.token_id)


def _canary_ids(tokenizer, windows: int, tokens: int, prefix_id: int | None = None):
    """windows x tokens ids of Python's own documentation (the packaged pydoc topics, always offline), the topics
    taken from the end of the sorted list (calibration recipes and the test models' training start at the beginning).
    With prefix_id every window is that token followed by tokens - 1 text tokens (the evaluation's convention)."""
    import torch

    from quantlab.stages.data import pydoc_topics

    topics = pydoc_topics()

    names = sorted(topics)[::-1]
    text, want = "", windows * tokens * 16  # characters: more than enough at any tokenizer's chars per token
    for name in names:
        if len(text) >= want:
            break
        text += topics[name].strip() + "\n\n"
    if prefix_id is None:
        ids = tokenizer(text[:want])["input_ids"]
        per = min(tokens, len(ids) // windows)
    else:
        ids = tokenizer(text[:want], add_special_tokens=False)["input_ids"]
        per = min(tokens, len(ids) // windows + 1)
    if per < 2:
        raise QuantlabError("the reference tokenizer gives too few tokens for the canary",
                            fix="check the reference's tokenizer, or run with --no-canary")
    if prefix_id is None:
        return torch.tensor(ids[: windows * per]).view(windows, per)
    body = torch.tensor(ids[: windows * (per - 1)]).view(windows, per - 1)
    return torch.cat([torch.full((windows, 1), prefix_id, dtype=body.dtype), body], dim=1)
