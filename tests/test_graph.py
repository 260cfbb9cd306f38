"""The run graph's two interpreters on toy steps: quantlab.graph.Executor (loads or builds) and quantlab.graph.Pricer
(prices without building), over a real ArtifactStore in tmp_path. No models, no torch: milliseconds."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from quantlab import graph
from quantlab.artifacts import ArtifactStore
from quantlab.config import Config
from quantlab.env import Device
from quantlab.graph import Executor, Pricer, cut, targets
from quantlab.step import Pending, RunContext, Step


@dataclass
class Toy:
    """A toy step's value: what its build wrote, and the fingerprint of the files it came from."""

    text: str
    fingerprint: str


def ctx_for(tmp_path, **memo) -> RunContext:
    return RunContext(Config(), ArtifactStore(tmp_path / "cache"), Device("cpu", None, "toy", None), None, dict(memo))


class Toys:
    """Declares toy steps over a real store and counts what each build and load did."""

    def __init__(self):
        self.built: list[str] = []  # names, in build order
        self.work: dict[str, object] = {}  # name -> extra work a build does (a callable given the resolver)

    def step(self, name: str, stage: str = "data", key_inputs: tuple[str, ...] = (), reads: tuple[str, ...] = (),
             needs: tuple[str, ...] | None = None, **kw) -> Step:
        """A stored step: its key hashes its name, the fingerprints of key_inputs and ctx.memo["variant"] (evaluate
        stage only); its build reads `reads` (declared in needs unless needs says otherwise) and writes one file."""

        def key(r):
            parts = {"name": name, "inputs": [r.fingerprint(n) for n in key_inputs]}
            if stage == "evaluate":
                parts["variant"] = r.ctx.memo.get("variant")
            return r.store.key(stage, **parts)

        def build(out, r):
            inputs = [r.value(n).text for n in reads]
            if name in self.work:
                self.work[name](r)
            self.built.append(name)
            (out / "value.txt").write_text("+".join([name, *inputs]))
            return {"made": name}

        def load(art, r, built):
            return Toy((art.path / "value.txt").read_text(), art.fingerprint)

        return Step(name, stage, key, load, build, needs=tuple(reads) if needs is None else needs, **kw)


def chain(toys: Toys) -> list[Step]:
    """a -> b -> c: each key formed from the fingerprint of the step before, each build reading it."""
    return [toys.step("a", "prepare"), toys.step("b", "data", key_inputs=("a",), reads=("a",)),
            toys.step("c", "evaluate", key_inputs=("b",), reads=("b",))]


def rows(priced) -> dict[str, tuple[str, bool]]:
    return {p.name: (p.status, p.placeholder) for p in priced}


# ------------------------------------------------------------------------------------------------ executor
def test_executor_builds_on_demand_then_a_new_run_loads_from_the_store(tmp_path):
    toys = Toys()
    ctx = ctx_for(tmp_path)
    first = Executor(ctx, chain(toys))
    first.run(["c"])
    assert toys.built == ["a", "b", "c"]
    assert first.values["c"].text == "c+b+a"
    assert [action for _, _, action in ctx.store.events] == ["built"] * 3
    assert first.artifacts["c"].info == {"made": "c"}
    assert set(first.seconds) == {"a", "b", "c"}

    ctx2 = ctx_for(tmp_path)
    second = Executor(ctx2, chain(toys))
    second.run(["c"])
    assert toys.built == ["a", "b", "c"]  # nothing built again
    assert [action for _, _, action in ctx2.store.events] == ["reused"] * 3
    assert second.keys == first.keys and second.values == first.values
    assert second.fingerprint("b") == first.artifacts["b"].fingerprint


def test_executor_builds_only_what_a_target_needs(tmp_path):
    toys = Toys()
    run = Executor(ctx_for(tmp_path), chain(toys))
    run.run(["b"])
    assert toys.built == ["a", "b"] and "c" not in run.values
    assert run.value("b") is run.value("b")  # loaded once


def test_a_build_reading_an_undeclared_step_is_an_assertion_error(tmp_path):
    toys = Toys()
    a = toys.step("a", "prepare")
    sneaky = toys.step("sneaky", "data", reads=("a",), needs=())  # reads a, declares nothing
    run = Executor(ctx_for(tmp_path), [a, sneaky])
    with pytest.raises(AssertionError, match="step sneaky read a, which it does not declare in needs"):
        run.value("sneaky")
    assert "sneaky" not in toys.built and run.ctx.store.entries() == []  # nothing half-built left in the store
    assert run._building == []  # the executor is usable after the error
    assert run.value("a").text == "a"


def test_a_build_may_read_cheap_steps_without_declaring_them(tmp_path):
    toys = Toys()
    ref = toys.step("ref", "prepare", cheap=True)
    user = toys.step("user", "data", reads=("ref",), needs=())
    run = Executor(ctx_for(tmp_path), [ref, user])
    assert run.value("user").text == "user+ref"


def test_keys_may_read_any_step_only_builds_are_checked(tmp_path):
    toys = Toys()
    steps = [toys.step("a", "prepare"), toys.step("b", "data", key_inputs=("a",), needs=())]
    run = Executor(ctx_for(tmp_path), steps)
    assert run.value("b").text == "b" and toys.built == ["a", "b"]


def test_actions_run_every_time_and_sources_are_loaded_not_stored(tmp_path):
    calls = []
    action = Step("act", "evaluate", lambda r: None, lambda art, r, built: built,
                  lambda out, r: calls.append(out) or len(calls))
    source = Step("src", "prepare", lambda r: r.value("src").fingerprint,
                  lambda art, r, built: Toy("from disk", "f00d"), source="local", cheap=True)
    ctx = ctx_for(tmp_path)
    for expected in (1, 2):
        run = Executor(ctx, [source, action])
        assert run.value("act") == expected and run.key("act") is None
        assert run.fingerprint("src") == "f00d" and "src" not in run.artifacts
    assert calls == [None, None] and ctx.store.entries() == []


def test_a_step_own_seconds_exclude_the_inputs_it_built(tmp_path, monkeypatch):
    """A fake clock that only the builds advance: `seconds` and the build's upstream_seconds are exact."""
    now = [1000.0]
    monkeypatch.setattr(graph, "time", SimpleNamespace(time=lambda: now[0]))

    def tick(seconds):
        def advance(r):
            now[0] += seconds
        return advance

    toys = Toys()
    toys.work.update(a=tick(5.0), b=tick(2.0), c=tick(0.5))
    # b reads a in its build (a is built inside b's build); c's key reads b's fingerprint (b is built while c's
    # key is formed, before c's build starts)
    steps = [toys.step("a", "prepare"), toys.step("b", "data", reads=("a",)),
             toys.step("c", "evaluate", key_inputs=("b",))]
    run = Executor(ctx_for(tmp_path), steps)
    run.run(["c"])
    assert toys.built == ["a", "b", "c"]
    assert run.seconds == {"a": 5.0, "b": 2.0, "c": 0.5}
    assert run.artifacts["b"].info["upstream_seconds"] == 5.0  # the store's cost record subtracts it
    assert "upstream_seconds" not in run.artifacts["c"].info  # b was made before c's build began
    assert "upstream_seconds" not in run.artifacts["a"].info

    again = Executor(ctx_for(tmp_path), steps)
    again.run(["c"])  # loaded: no clock advances, and a (read only by b's build) is not even loaded
    assert again.seconds == {"b": 0.0, "c": 0.0} and "a" not in again.values


# ------------------------------------------------------------------------------------------------ pricer
def test_pricer_on_an_empty_store_builds_everything_with_placeholder_keys(tmp_path):
    toys = Toys()
    ctx = ctx_for(tmp_path)
    pricer = Pricer(ctx, chain(toys), history=[], seen=set())
    priced = pricer.price(["c"])
    assert rows(priced) == {"a": ("build", False), "b": ("build", True), "c": ("build", True)}
    assert toys.built == [] and ctx.store.entries() == []  # pricing builds nothing
    assert [p.stage for p in priced] == ["prepare", "data", "evaluate"]
    assert all(p.estimate is None for p in priced)  # no `work` declared: nothing to estimate from

    run = Executor(ctx, chain(toys))
    run.run(["c"])
    assert pricer.keys["a"] == run.keys["a"]  # a key formed from what exists is the real one
    assert pricer.keys["b"] != run.keys["b"] and pricer.keys["c"] != run.keys["c"]  # placeholders were not


def test_pricer_keys_match_the_executor_and_cached_steps_are_cached(tmp_path):
    toys = Toys()
    ctx = ctx_for(tmp_path)
    Executor(ctx, chain(toys)).run(["c"])
    pricer = Pricer(ctx, chain(toys), history=[], seen=set())
    assert rows(pricer.price(["c"])) == {"a": ("cached", False), "b": ("cached", False), "c": ("cached", False)}
    run = Executor(ctx, chain(toys))
    run.run(["c"])
    assert pricer.keys == run.keys


def test_pricer_partly_cached_and_not_needed(tmp_path):
    toys = Toys()
    ctx = ctx_for(tmp_path)
    Executor(ctx, chain(toys)).run(["a"])
    assert rows(Pricer(ctx, chain(toys), [], set()).price(["c"])) == {
        "a": ("cached", False), "b": ("build", False), "c": ("build", True)}
    # a target before c: c is not needed; with a cached, b's key is real
    assert rows(Pricer(ctx, chain(toys), [], set()).price(["b"])) == {
        "a": ("cached", False), "b": ("build", False), "c": ("not needed", True)}


def test_pricer_build_demands_what_the_build_reads(tmp_path):
    toys = Toys()
    ctx = ctx_for(tmp_path)
    steps = [toys.step("a", "prepare"), toys.step("b", "data", reads=("a",)), toys.step("lonely", "data")]
    assert rows(Pricer(ctx, steps, [], set()).price(["b"])) == {
        "a": ("build", False), "b": ("build", False), "lonely": ("not needed", False)}
    Executor(ctx, steps).run(["b"])
    assert rows(Pricer(ctx, steps, [], set()).price(["b"])) == {  # b cached: what its build reads is not needed
        "a": ("not needed", False), "b": ("cached", False), "lonely": ("not needed", False)}


def test_pending_values_propagate_through_keys(tmp_path):
    """A key that needs a value not built yet is "pending:<name>:<digest of the config it depends on>" (two runs
    whose configs differ there do not share it); every key formed from it is a placeholder."""
    toys = Toys()

    def pending_key(r):
        return r.store.key("data", model=r.value("a").text)  # a's value, not its fingerprint: Pending while planning

    a = toys.step("a", "prepare", cheap=True)
    d = Step("d", "data", pending_key, lambda art, r, built: Toy("d", art.fingerprint),
             lambda out, r: (out / "d.txt").write_text("d") and {}, needs=("a",))
    e = Step("e", "quantize", lambda r: r.store.key("quantize", d=r.key("d")), lambda art, r, built: Toy("e", ""),
             lambda out, r: (out / "e.txt").write_text("e") and {}, needs=("d",))
    ctx = ctx_for(tmp_path)
    pricer = Pricer(ctx, [a, d, e], [], set())
    priced = {p.name: p for p in pricer.price(["e"])}
    assert priced["d"].key.startswith("pending:d:") and priced["d"].placeholder
    assert priced["e"].placeholder and not priced["e"].key.startswith("pending:")  # a real hash of a placeholder
    assert (priced["a"].status, priced["d"].status, priced["e"].status) == ("build", "build", "build")
    with pytest.raises(Pending):
        pricer.value("a")  # not built yet
    d_first = {p.name: p for p in Pricer(ctx, [a, d, e], [], set()).price(["d", "e"])}
    assert d_first["e"].placeholder  # d's pending key formed before e's: still marks e

    run = Executor(ctx, [a, d, e])
    run.run(["e"])
    assert not run.keys["d"].startswith("pending:") and run.keys["e"] != priced["e"].key
    again = {p.name: p for p in Pricer(ctx, [a, d, e], [], set()).price(["e"])}
    assert again["e"].status == "cached" and again["d"].status == "not needed"  # e's key reads d's key only
    assert not again["d"].placeholder
    assert again["d"].key == run.keys["d"] and again["e"].key == run.keys["e"] and not again["e"].placeholder


def test_a_later_run_of_a_sweep_finds_the_earlier_runs_builds_shared(tmp_path):
    toys, seen = Toys(), set()
    first = Pricer(ctx_for(tmp_path, variant="x"), chain(toys), [], seen).price(["c"])
    second = Pricer(ctx_for(tmp_path, variant="y"), chain(toys), [], seen).price(["c"])
    assert rows(first) == {"a": ("build", False), "b": ("build", True), "c": ("build", True)}
    # a and b have the same keys in both runs; c's key has the variant in it
    assert rows(second) == {"a": ("shared", False), "b": ("shared", True), "c": ("build", True)}
    third = Pricer(ctx_for(tmp_path, variant="x"), chain(toys), [], seen).price(["c"])
    assert {p.status for p in third} == {"shared"}


def test_pricer_statuses_of_sources_and_actions(tmp_path):
    src = Step("src", "prepare", lambda r: r.value("src").fingerprint,
               lambda art, r, built: Toy("from disk", "f00d"), source="local", cheap=True)
    act = Step("act", "evaluate", lambda r: None, lambda art, r, built: built, lambda out, r: 1, needs=("src",))
    priced = Pricer(ctx_for(tmp_path), [src, act], [], set()).price(["act"])
    assert [(p.name, p.status, p.key) for p in priced] == [("src", "local", "f00d"), ("act", "run", "-")]


def test_probed_steps_are_priced_by_their_first_artifact(tmp_path):
    """A step made of many artifacts (an evaluation) is cached when the artifact its probe names is stored, shared
    when an earlier run of the sweep builds it, and a placeholder when its probe needs a value not built yet."""
    toys = Toys()
    a = toys.step("a", "prepare", cheap=True)

    def probe(r):
        return "blocks", r.store.key("blocks", a=r.value("a").text, variant=r.ctx.memo.get("variant"))

    def build(out, r):
        directory, key = probe(r)
        r.store.get_or_build(directory, key, lambda tmp: (tmp / "block").write_text("b") and {}, {})
        return "evaluated"

    ev = Step("ev", "evaluate", lambda r: None, lambda art, r, built: built, build, needs=("a",), probe=probe)
    ctx, seen = ctx_for(tmp_path, variant="x"), set()
    first = {p.name: p for p in Pricer(ctx, [a, ev], [], seen).price(["ev"])}
    priced = first["ev"]
    assert (priced.status, priced.key.rpartition(":")[0], priced.placeholder) == ("build", "pending:ev", True)
    assert first["a"].status == "build"

    assert Executor(ctx, [a, ev]).value("ev") == "evaluated"
    cached = {p.name: p for p in Pricer(ctx, [a, ev], [], seen).price(["ev"])}
    assert (cached["ev"].status, cached["ev"].placeholder) == ("cached", False)
    assert cached["ev"].key == probe(Executor(ctx, [a, ev]))[1] and cached["a"].status == "not needed"

    other, sweep = ctx_for(tmp_path, variant="y"), set()
    assert rows(Pricer(other, [a, ev], [], sweep).price(["ev"]))["ev"] == ("build", False)
    assert rows(Pricer(other, [a, ev], [], sweep).price(["ev"]))["ev"] == ("shared", False)


# ------------------------------------------------------------------------------------------ cut, targets
def _run_shape() -> list[Step]:
    """The shape steps_for declares (names, stages, targets), with do-nothing functions."""

    def s(name, stage, **kw):
        return Step(name, stage, lambda r: None, lambda art, r, built: None, **kw)

    return [s("prepare", "prepare"), s("data:calib", "data"), s("data:eval", "data"), s("quantize", "quantize"),
            s("export", "export"), s("audit", "export"), s("reference", "evaluate", target=False),
            s("build:torch", "build"), s("evaluate:torch", "evaluate"), s("evaluate:fakequant", "evaluate")]


@pytest.mark.parametrize("stop_after,kept,wanted", [
    ("prepare", ["prepare"], ["prepare"]),
    ("data", ["prepare", "data:calib", "data:eval"], ["prepare", "data:calib", "data:eval"]),
    ("quantize", ["prepare", "data:calib", "data:eval", "quantize"],
     ["prepare", "data:calib", "data:eval", "quantize"]),
    ("export", ["prepare", "data:calib", "data:eval", "quantize", "export", "audit"],
     ["prepare", "data:calib", "data:eval", "export", "audit"]),
    ("build", ["prepare", "data:calib", "data:eval", "quantize", "export", "audit", "build:torch"],
     ["prepare", "data:calib", "data:eval", "export", "audit", "build:torch"]),
    (None, ["prepare", "data:calib", "data:eval", "quantize", "export", "audit", "reference", "evaluate:torch",
            "evaluate:fakequant"],
     ["prepare", "data:calib", "data:eval", "export", "audit", "evaluate:torch", "evaluate:fakequant"]),
])
def test_cut_and_targets(stop_after, kept, wanted):
    steps = cut(_run_shape(), stop_after)
    assert [s.name for s in steps] == kept
    assert targets(steps) == wanted


def test_targets_without_export_or_audit():
    shape = [s for s in _run_shape() if s.name not in ("quantize", "export", "audit")]  # engine=reference
    assert targets(cut(shape, None)) == ["prepare", "data:calib", "data:eval", "evaluate:torch", "evaluate:fakequant"]
