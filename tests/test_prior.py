"""A-priori build times (quantlab.prior): the plan of a machine's first run prices every step from the model's shape
and the machine's measured speed; the embedded models' declared shapes are their GGUFs'."""
from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import cli_env, compose

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def _gguf_shape(path: Path) -> dict:
    """The shape a GGUF declares (its architecture's metadata) and its parameter count."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {f.name: f for f in reader.fields.values()}
    arch = str(bytes(fields["general.architecture"].parts[-1]), "utf-8")

    def value(name):
        f = fields.get(f"{arch}.{name}")
        return int(f.parts[f.data[0]][0]) if f is not None else None

    heads = value("attention.head_count")
    return {"num_hidden_layers": value("block_count"), "hidden_size": value("embedding_length"),
            "intermediate_size": value("feed_forward_length"), "num_attention_heads": heads,
            "num_key_value_heads": value("attention.head_count_kv"),
            "head_dim": value("attention.key_length") or value("embedding_length") // heads,
            "vocab_size": len(fields["tokenizer.ggml.tokens"].data),
            "params": sum(math.prod(int(d) for d in t.shape) for t in reader.tensors)}


@pytest.mark.parametrize("name", [pytest.param("smollm2_135m"), pytest.param("gemma3_270m", marks=pytest.mark.slow)])
def test_an_embedded_models_declared_shape_is_its_ggufs(name, tmp_path):
    """conf/model/NAME.yaml's shape (what the plan prices a machine's first run at, before the conversion) equals what
    the GGUF says: layers, widths, heads, vocabulary and parameters."""
    emb = yaml.safe_load((CONF / f"{name}.yaml").read_text())["embedded"]
    if importlib.util.find_spec(emb["package"]) is None:
        pytest.skip(f"{emb['package']} is not installed (an optional model)")
    if emb.get("parts"):
        path = tmp_path / emb["file"]
        importlib.import_module(emb["package"]).assemble(path)
    else:
        path = Path(list(importlib.util.find_spec(emb["package"]).submodule_search_locations)[0]) / emb["file"]
    assert emb["shape"] == _gguf_shape(path)


def test_a_machines_first_plan_prices_every_step(tmp_path):
    """An empty cache (a machine's or a model's first run): the plan prices every step it will build a-priori, and a
    second precision shares the conversion and the token sets but builds its own calibration (before, every cell of
    such a plan read "build ?", and the second precision's calibration was "shared" with the first's)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "quantlab", "--plan", "-m", "+precision=fp8,int8_sq"], cwd=tmp_path,
                         env=cli_env(tmp_path / "cache"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line.strip().startswith("precision=")}
    assert set(rows) == {"precision=fp8", "precision=int8_sq"}, res.stdout
    assert "build ?" not in res.stdout and "a-priori" in res.stdout, res.stdout
    fp8, sq = rows["precision=fp8"], rows["precision=int8_sq"]
    assert fp8[1] == "build" and sq[1] == "shared", res.stdout  # the conversion
    assert sq.count("shared") == 4 and sq.count("build") >= 3, res.stdout  # prepare, calib, eval, reference
    assert (tmp_path / "cache" / "machine_speed.json").is_file()


def test_the_evaluation_text_is_priced_at_the_windows_it_gives():
    """Before the text is tokenized, the plan counts its windows from its characters (the default text's 70 windows
    of 512 tokens within 15%; a cap below that is the count) and prices what a passing run reads: the first look
    where its tail checks can pass (Gemma-3-270M at 256 tokens under a cap of 96 passed at look 8: 64 windows)."""
    from quantlab import first_run

    assert abs(first_run._cold_windows(compose(["+precision=fp8"])[0]) - 70) <= 10
    assert first_run._cold_windows(compose(["+precision=fp8", "eval.max_windows=16"])[0]) == 16
    short = compose(["+precision=fp8", "eval.seq_len=256", "eval.max_windows=96"])[0]
    assert first_run._cold_windows(short) == 96 and first_run._cold_windows(short, "fp8") == 64


def test_the_a_priori_time_grows_with_the_work():
    """More tokens, a wider vocabulary, more layers or another precision's engine: more seconds, in proportion where
    the work is matmuls."""
    from quantlab import prior

    machine = {"matmul_flops": 1e11, "elementwise_per_s": 1e9, "launch_s": 2e-6, "hash_bytes_per_s": 2e9}
    small = prior.Shape.of({"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                            "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}, 134_515_008)
    wide = prior.Shape.of({"text_config": {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                                           "num_attention_heads": 9, "num_key_value_heads": 3,
                                           "vocab_size": 262144}}, 285_000_000)
    assert small.head_dim == 64 and wide.vocab == 262144
    zero, one, two = (prior.seconds("reference", prior.reference(small, n, 512, 4), "cpu", machine)
                      for n in (0, 4096, 8192))
    assert two > one > zero > 0 and abs((two - zero) / (one - zero) - 2.0) < 1e-6  # linear beyond loading the model
    assert prior.seconds("reference", prior.reference(wide, 4096, 512, 4), "cpu", machine) > one
    units = prior.evaluation(small, 4096, 512, 4, 0, (0, 0))
    fp8, sq = (prior.seconds("evaluate", units, "cpu", machine, f"torch:{p}/kv=none") for p in ("fp8", "int8_sq"))
    assert fp8 > sq  # the CPU emulates FP8 around float32 GEMMs
    moe = prior.Shape.of({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
                          "moe_intermediate_size": 32, "num_experts_per_tok": 4, "num_attention_heads": 4,
                          "vocab_size": 100}, 10)
    assert moe.inter == 128  # the active experts' width
    mixtral = prior.Shape.of({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 224,
                              "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4,
                              "vocab_size": 100}, 10)
    assert mixtral.inter == 448  # experts named by intermediate_size: still the active ones
    assert prior.Shape.of({"hidden_size": 64}, 1) is None
