"""engine=served: the dialects that take windows as token ids (vllm, sglang, trtllm): each one's request, its
response parsed into per-position log-probs, and greedy continuations' ids."""
from __future__ import annotations

from quantlab.engines.served_http import malformed, parsing
from quantlab.errors import QuantlabError


# Written to the servers' documented APIs and NOT run here (no GPU serving stack on the project's machines):
#   vllm   POST /v1/completions, prompt as token ids, the `prompt_logprobs` extra parameter (k capped by the server's
#          --max-logprobs, default 20); choices[0].prompt_logprobs: one entry per prompt token, None first, else
#          {"<id>": {"logprob", "rank", "decoded_token"}} holding the top k and the prompt's own token.
#   sglang POST /generate (native API) with input_ids, return_logprob, logprob_start_len 0, top_logprobs_num k;
#          meta_info.input_token_logprobs [[logprob | None, id, text | None], ...] and input_top_logprobs.
#   trtllm POST /v1/completions (trtllm-serve), prompt as token ids, return_context_logits (the full [T, V] logits
#          of the prompt; its TensorRT backend needs an engine built with context logits gathered).
def _vllm_request(model, ids, k):
    return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                               "prompt_logprobs": k, "add_special_tokens": False}


def _sglang_request(_model, ids, k):
    return "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                         "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k}


def _trtllm_request(model, ids, _k):
    return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                               "return_context_logits": True, "add_special_tokens": False}


def echo_mismatch(ids: list[int], got: list[int], where: str) -> QuantlabError:
    """The server's prompt is not the window: exit 2 naming the first differing position and the likely cause."""
    d = next((i for i, (a, b) in enumerate(zip(ids, got, strict=False)) if a != b), min(len(ids), len(got)))
    cause = ("the server added a token (BOS) to the prompt" if len(got) > len(ids) and got[1:] == ids[: len(got) - 1]
             else "the server's tokenizer or checkpoint is not the one quantlab evaluates")
    return QuantlabError(f"the server at {where} does not see the tokens sent: {len(got)} prompt tokens for "
                         f"{len(ids)} sent, first difference at position {d}; likely cause: {cause}",
                         fix="serve the checkpoint and tokenizer quantlab evaluates, with no template or BOS added "
                             "(add_special_tokens is sent false)")


def _choice(out: dict, where: str) -> dict:
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed(where, "no 'choices'")
    return choices[0]


def _number(value, where: str, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise malformed(where, f"{what} is not a number")
    return float(value)


def parse_vllm(out: dict, ids: list[int], k: int, where: str) -> tuple[list, list, list]:
    """vLLM's prompt_logprobs -> per predicted position (target log-prob, top ids, top log-probs)."""
    plp = _choice(out, where).get("prompt_logprobs")
    if not isinstance(plp, list):
        raise QuantlabError(f"the server at {where} returned no prompt_logprobs",
                            fix="use a vLLM with prompt_logprobs on /v1/completions, started with --max-logprobs "
                                f">= engine.top_logprobs ({k})")
    if len(plp) != len(ids):
        raise echo_mismatch(ids, [-1] * len(plp), where)
    target, tops_i, tops_l = [], [], []
    for p in range(1, len(ids)):
        entry = plp[p]
        if not isinstance(entry, dict) or not all(isinstance(v, dict) for v in entry.values()):
            raise malformed(where, f"prompt_logprobs[{p}] is not {{id: {{logprob, rank}}}}")
        if str(ids[p]) not in entry:  # vLLM always lists the prompt's own token: another one means another prompt
            raise echo_mismatch(ids, [*ids[:p], -1], where)
        target.append(_number(entry[str(ids[p])].get("logprob"), where, f"prompt_logprobs[{p}] logprob"))
        ranked = sorted(((_number(v.get("logprob"), where, "a logprob"), int(key)) for key, v in entry.items()
                         if isinstance(v.get("rank"), int) and v["rank"] <= k), reverse=True)[:k]
        tops_i.append([i for _, i in ranked])
        tops_l.append([lp for lp, _ in ranked])
    return target, tops_i, tops_l


def parse_sglang(out: dict, ids: list[int], k: int, where: str) -> tuple[list, list, list]:
    """SGLang's input_token_logprobs / input_top_logprobs -> per predicted position (target, top ids, top lps)."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict) or not isinstance(meta.get("input_token_logprobs"), list):
        raise QuantlabError(f"the server at {where} returned no input_token_logprobs",
                            fix="use SGLang's native /generate with return_logprob (engine.dialect=sglang)")
    toks, tops = meta["input_token_logprobs"], meta.get("input_top_logprobs")
    if not all(isinstance(t, list) and len(t) >= 2 for t in toks) or not isinstance(tops, list) \
            or len(tops) != len(toks):
        raise malformed(where, "input_token_logprobs / input_top_logprobs are not lists of [logprob, id, text]")
    got = [t[1] for t in toks]
    if got != ids:
        raise echo_mismatch(ids, got, where)
    target, tops_i, tops_l = [], [], []
    for p in range(1, len(ids)):
        target.append(_number(toks[p][0], where, f"input_token_logprobs[{p}]"))
        row = tops[p] if isinstance(tops[p], list) else []
        ranked = sorted(((_number(t[0], where, "a top logprob"), int(t[1])) for t in row), reverse=True)[:k]
        tops_i.append([i for _, i in ranked])
        tops_l.append([lp for lp, _ in ranked])
    return target, tops_i, tops_l


def parse_trtllm(out: dict, ids: list[int], k: int, where: str) -> tuple[list, list, list]:
    """trtllm-serve's context_logits [T, V] -> per predicted position (target, top ids, top log-probs)."""
    import numpy as np

    choice = _choice(out, where)
    logits = choice.get("context_logits")
    if not isinstance(logits, list) or len(logits) != len(ids):
        raise QuantlabError(f"the server at {where} returned no context logits for the {len(ids)} prompt tokens",
                            fix="start trtllm-serve with context logits gathered (the TensorRT backend: an engine "
                                "built with --gather_context_logits)")
    sent = out.get("prompt_token_ids")
    if isinstance(sent, list) and sent and sent != ids:
        raise echo_mismatch(ids, sent, where)
    usage = out.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int) and usage["prompt_tokens"] != len(ids):
        raise echo_mismatch(ids, [-1] * usage["prompt_tokens"], where)
    x = np.asarray(logits[:-1], dtype=np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    top = np.argsort(-lp, -1)[:, :k]
    rows = np.arange(len(ids) - 1)
    return (lp[rows, ids[1:]].tolist(), top.tolist(), np.take_along_axis(lp, top, -1).tolist())


REQUESTS = {"vllm": _vllm_request, "sglang": _sglang_request, "trtllm": _trtllm_request}
PARSERS = {"vllm": parse_vllm, "sglang": parse_sglang, "trtllm": parse_trtllm}


def generated_ids(engine, row: list[int], n: int) -> list[int]:
    """Greedy continuation ids from an id dialect (vLLM: return_tokens_as_token_ids; SGLang: the output tokens'
    ids; trtllm-serve: the choice's token_ids); -1 past an early stop. engine: the ServedEngine (its cfg and
    client)."""
    path = "/generate" if engine.cfg.dialect == "sglang" else "/v1/completions"
    with parsing(engine.client.base + path):
        return _generated_ids(engine, row, n)


def _generated_ids(engine, row: list[int], n: int) -> list[int]:
    client, model = engine.client, engine.cfg.model
    if engine.cfg.dialect == "sglang":
        out = client.call("/generate", {"input_ids": row, "return_logprob": True, "logprob_start_len": len(row),
                                        "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                            "ignore_eos": True}})
        toks = (out.get("meta_info") or {}).get("output_token_logprobs")
        got = [t[1] for t in toks] if isinstance(toks, list) else None
    else:
        body = {"model": model, "prompt": row, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                "add_special_tokens": False}
        if engine.cfg.dialect == "vllm":
            body.update(logprobs=1, return_tokens_as_token_ids=True)
        choice = _choice(client.call("/v1/completions", body), client.base + "/v1/completions")
        if engine.cfg.dialect == "vllm":
            texts = (choice.get("logprobs") or {}).get("tokens")
            got = [int(t.split(":", 1)[1]) for t in texts] if isinstance(texts, list) and all(
                isinstance(t, str) and t.startswith("token_id:") for t in texts) else None
        else:
            got = choice.get("token_ids")
    if not isinstance(got, list) or not all(isinstance(i, int) for i in got):
        raise malformed(client.base, "no generated token ids")
    return got[:n] + [-1] * (n - len(got[:n]))

