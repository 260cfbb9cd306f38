"""evaluate: reference and candidate on the same windows, block by block, until the gate is decided.

Windows are taken in blocks of gate.statistical.look_windows (one block per look of the sequential design).
- The reference's block: its final hidden states (the input of its output head), target NLL and argmax, plus its
  greedy generations in block 0. Cached once per (model, eval data, settings, block) and shared by every precision
  of a sweep; its head (lm_head weight and post-processing) is cached beside it.
- A candidate's block: per-position arrays (NLLs, exact full-vocabulary KL, delta-p, argmaxes) computed by
  recomputing the reference's logits from its hidden states and comparing them with the candidate's, a chunk of
  positions at a time (no [positions x vocabulary] tensor for a whole window is ever held). Cached per
  (candidate, reference, block), so a rerun, a stricter gate or a later search reads them back.
- The evaluation step runs the looks: after each block the gate's checks are decided (quantlab.gate.checks) and it
  stops once none is undecided or one has failed, or at the cap. The windows are stored in the data stage's look
  order (spread across the text's documents) and carry their documents, the clusters of every interval.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantlab import costs, progress
from quantlab.artifacts import ArtifactStore, Built
from quantlab.config import EvalConfig
from quantlab.engines.base import Limits
from quantlab.engines.registry import ENGINES, EngineSpec
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.gate import metrics
from quantlab.gate.metrics import POSITION_FIELDS, Windows
from quantlab.stages.build import RUNS_NEEDS, build_engine, limits
from quantlab.stages.data import TokenSet
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")
REF_FILE, HEAD_FILE, CAND_FILE = "reference.safetensors", "head.safetensors", "positions.safetensors"
LOGIT_BUDGET = 1 << 23  # elements of one logits chunk (x ~6 float64 temporaries): bounds memory at long context


@dataclass
class EvalResult:
    """One candidate compared with the reference on the windows the gate needed."""

    engine: str
    metrics: dict
    windows: dict  # per-window arrays (lists) for CIs, plots and baseline comparison
    positions: dict  # per-position means along the window (plots)
    panel: dict  # behaviour panel (KL and delta-p distributions, flips)
    buckets: list  # metrics per position bucket
    kl_values: np.ndarray = field(repr=False)
    generation: dict | None = None
    argmax: np.ndarray | None = field(default=None, repr=False)  # [windows, positions] candidate predictions
    per_window: Windows | None = field(default=None, repr=False)
    checks: list = field(default_factory=list)  # gate.checks.Check of the last look
    look: int = 0
    design: object = None
    forward_batches: int = 0
    seconds: float = 0.0
    computed_now: bool = False  # some block was evaluated in this run (not read from the store)
    warnings: list = field(default_factory=list)  # about the evaluation text (quantlab.gate.checks.check_documents)
    numerics: dict | None = None  # how far another CPU's arithmetic moves the metrics (numerics_noise)


def _oom_guard(fn, batch_size: int):
    import torch

    try:
        return fn()
    except torch.OutOfMemoryError:
        raise QuantlabError(f"out of memory evaluating a batch of {batch_size} windows",
                            fix=f"lower eval.batch_size to {max(1, batch_size // 2)}") from None
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower():
            raise QuantlabError(f"out of memory evaluating a batch of {batch_size} windows",
                                fix=f"lower eval.batch_size to {max(1, batch_size // 2)}") from None
        raise


def _prompts(evalset: TokenSet, cfg: EvalConfig):
    n = min(cfg.gen_prompts, evalset.num_windows)
    return evalset.tokens[:n, : cfg.gen_prompt_len] if n and cfg.gen_tokens else None


HEAD_ROWS = 128  # rows of one head GEMM at least: at 32 a 262k-vocabulary head ran 1.5x slower a row on a CPU


def _chunk(batch: int, vocab: int) -> int:
    """Positions per logits chunk: LOGIT_BUDGET logits, but at least HEAD_ROWS rows for the head's GEMM, which reads
    the whole head weight per chunk (a large vocabulary's chunk of a few positions is bound by that read)."""
    return max(1, LOGIT_BUDGET // max(1, batch * vocab), -(-HEAD_ROWS // max(1, batch)))


# --------------------------------------------------------------------------------------------- reference
def reference_key(store: ArtifactStore, model_fp: str, data_fp: str, cfg: EvalConfig, device, dtype,
                  block_windows: int) -> str:
    """Identity of the reference's outputs on an eval set (its blocks add their index)."""
    return store.key("reference", model=model_fp, data=data_fp, dtype=str(dtype), device=device.type,
                     metrics=metrics.FORMULA_VERSION, block=block_windows,
                     gen=[cfg.gen_prompts, cfg.gen_prompt_len, cfg.gen_tokens], versions=versions())


def write_reference_block(out: Path, engine, tokens, cfg: EvalConfig, prompts=None) -> dict:
    """The reference engine's final hidden states, target NLL and argmax for a block of windows (and its greedy
    generations for block 0), as REF_FILE in out."""
    from safetensors.torch import save_file

    start = time.time()
    arrays = reference_arrays(engine, tokens, cfg, prompts)
    save_file({k: v.contiguous() for k, v in arrays.items()}, str(out / REF_FILE))
    return {"forward_batches": engine.forward_batches, "seconds": round(time.time() - start, 2),
            "windows": int(tokens.shape[0])}


def reference_arrays(engine, tokens, cfg: EvalConfig, prompts=None) -> dict:
    """hidden [n, T, H], nll and argmax [n, T-1] of the reference engine on windows (gen: greedy continuations)."""
    import torch

    hidden, nll, argmax, router = [], [], [], []
    for lo in progress.iterate(range(0, tokens.shape[0], cfg.batch_size), "reference", tokens.shape[0], "windows",
                               cfg.batch_size):
        batch = tokens[lo: lo + cfg.batch_size]
        if lo == 0 and hasattr(engine, "verify_head"):
            engine.verify_head(batch[:1, : min(batch.shape[1], 64)])
        res = _oom_guard(lambda batch=batch: engine.forward(batch), cfg.batch_size)
        targets = batch[:, 1:].to(res.hidden.device)
        t = targets.shape[1]
        step = _chunk(batch.shape[0], engine.head.vocab)
        parts = [metrics.nll_and_argmax(res.logits(p, min(p + step, t)), targets[:, p: p + step])
                 for p in range(0, t, step)]
        nll.append(torch.cat([a for a, _ in parts], 1).cpu())
        argmax.append(torch.cat([b for _, b in parts], 1).cpu())
        hidden.append(res.hidden.detach().cpu())
        if res.router is not None:
            router.append(res.router.cpu())
    arrays = {"hidden": torch.cat(hidden), "nll": torch.cat(nll), "argmax": torch.cat(argmax)}
    if router:
        arrays["router"] = torch.cat(router)
    if prompts is not None:
        arrays["gen"] = engine.greedy(prompts, cfg.gen_tokens).cpu()
    return arrays


def write_head(out: Path, engine) -> dict:
    """Save the reference engine's output head (weight, bias if any) as HEAD_FILE in out; the info holds its
    post-processing."""
    from safetensors.torch import save_file

    weight, bias = engine.head_weights()
    tensors = {"weight": weight.detach().cpu().contiguous()}
    if bias is not None:
        tensors["bias"] = bias.detach().cpu().contiguous()
    save_file(tensors, str(out / HEAD_FILE))
    return {"post": list(engine.head.post) if engine.head.post else None}


class ReferenceOutputs:
    """The reference's outputs, block by block: loaded from the store or computed (once) with the reference engine,
    which is built only if a block is missing."""

    def __init__(self, ctx: RunContext, base_key: str, evalset: TokenSet, make_engine, cost=None):
        self.ctx, self.base_key, self.evalset, self.cost = ctx, base_key, evalset, cost
        self.cfg = ctx.cfg.eval
        self.block_windows = ctx.cfg.gate.statistical.look_windows
        self._make_engine, self._engine = make_engine, None
        self._head = None
        self.forward_batches = 0

    @property
    def store(self) -> ArtifactStore:
        """The run's artifact store."""
        return self.ctx.store

    @property
    def fingerprint(self) -> str:
        """The base key, which identifies the reference's outputs (blocks add their index)."""
        return self.base_key

    def engine(self):
        """The reference engine, built on first use."""
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    def span(self, b: int) -> tuple[int, int]:
        """Window range [lo, hi) of block b."""
        lo = b * self.block_windows
        return lo, min(lo + self.block_windows, self.evalset.num_windows)

    def block_key(self, b: int) -> str:
        """The store key of block b."""
        return self.store.key("reference", base=self.base_key, block=b)

    def block(self, b: int) -> dict:
        """Block b's arrays (hidden, nll, argmax; router and gen where present), loaded or computed once."""
        from safetensors.torch import load_file

        lo, hi = self.span(b)
        prompts = _prompts(self.evalset, self.cfg) if b == 0 else None

        def build(out: Path) -> dict:
            engine = self.engine()
            before = engine.forward_batches
            info = write_reference_block(out, engine, self.evalset.tokens[lo:hi], self.cfg, prompts)
            self.forward_batches += engine.forward_batches - before
            return info

        art, built = self.store.get_or_build("reference", self.block_key(b), build,
                                         {"data": self.evalset.fingerprint, "block": [lo, hi], "versions": versions()},
                                         describe=f"reference outputs, windows {lo + 1}-{hi}",
                                         cost=self.cost(hi - lo) if self.cost else None)
        if built is not None:
            log.info("  reference windows %d-%d of %d (%.1f s)", lo + 1, hi, self.evalset.num_windows,
                     built.info["seconds"])
        return load_file(str(art.path / REF_FILE))

    def head(self):
        """The reference's output head (recomputes its exact logits from cached hidden states)."""
        from safetensors.torch import load_file

        from quantlab.engines.head import Head

        if self._head is None:
            key = self.store.key("reference_head", base=self.base_key)
            art, _ = self.store.get_or_build("reference", key, lambda out: write_head(out, self.engine()),
                                             {"versions": versions()}, describe="reference head")
            tensors = load_file(str(art.path / HEAD_FILE), device=str(self.ctx.device.torch))
            post = art.info.get("post")
            self._head = Head.from_weights(tensors["weight"], tensors.get("bias"), tuple(post) if post else None)
        return self._head

    def close(self) -> None:
        """Release the reference engine if one was built."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None


# ---------------------------------------------------------------------------------------------- candidate
def compare_block(engine, tokens, ref_block: dict, head, cfg: EvalConfig, prompts=None) -> dict:
    """Per-position arrays of one candidate on one block of windows (and its generations on block 0)."""
    import torch

    if hasattr(engine, "verify_head"):
        engine.verify_head(tokens[:1, : min(tokens.shape[1], 64)])
    fields: dict[str, list] = {k: [] for k in POSITION_FIELDS}
    extra: dict[str, list] = {"ref_out": [], "repeat_max_abs_dlogprob": [], "ambiguous": []}
    router: list = []
    for blo in progress.iterate(range(0, tokens.shape[0], cfg.batch_size), "candidate", tokens.shape[0], "windows",
                                cfg.batch_size):
        batch = tokens[blo: blo + cfg.batch_size]
        out = _oom_guard(lambda batch=batch: engine.forward(batch), cfg.batch_size)
        if out.sparse is not None:  # a server: sparse log-probs, no logits (quantlab.engines.served)
            _compare_sparse_batch(out.sparse, batch, ref_block["hidden"][blo: blo + batch.shape[0]], head, fields,
                                  extra)
            if blo == 0 and prompts is not None and hasattr(engine, "repeat_check"):
                extra["repeat_max_abs_dlogprob"].append(torch.tensor([engine.repeat_check(batch[:1])]))
            continue
        if out.router is not None and "router" in ref_block:
            ref_ids = ref_block["router"][blo: blo + batch.shape[0]]
            router.append(metrics.router_agreement(ref_ids, out.router)[:, :-1].cpu())
        rows = _by_chunks(batch, ref_block["hidden"][blo: blo + batch.shape[0]], head, POSITION_FIELDS,
                          lambda ref_logits, p, q, targets, out=out: metrics.compare_positions(
                              ref_logits, out.logits(p, q).to(ref_logits.device), targets))
        for k in POSITION_FIELDS:
            fields[k].append(rows[k])
        del out
    arrays = {k: torch.cat(v).to(getattr(torch, POSITION_FIELDS[k])) for k, v in fields.items()}
    if router:
        arrays["router_agree"] = torch.cat(router).float()
    arrays.update({k: torch.cat(v).float() for k, v in extra.items() if v})
    if prompts is not None and "gen" in ref_block:
        arrays["gen"] = engine.greedy(prompts, cfg.gen_tokens).cpu()
        arrays["gen_ref"] = ref_block["gen"]  # so a cached candidate needs nothing of the reference
    return arrays


def _by_chunks(batch, ref_hidden, head, keys, compare) -> dict:
    """compare(reference logits, p, q, targets) over the batch's predicted positions in chunks of _chunk positions
    (nothing of [positions x vocabulary] for more of them at once), each key's rows joined along positions."""
    import torch

    device = head.device
    targets, ref_hidden = batch[:, 1:].to(device), ref_hidden.to(device)
    t = targets.shape[1]
    step = _chunk(batch.shape[0], head.vocab)
    rows: dict[str, list] = {k: [] for k in keys}
    for p in range(0, t, step):
        q = min(p + step, t)
        cmp = compare(head(ref_hidden[:, p:q]), p, q, targets[:, p:q])
        for k in keys:
            rows[k].append(cmp[k].cpu())
    return {k: torch.cat(v, 1) for k, v in rows.items()}


def _compare_sparse_batch(sparse, batch, ref_hidden, head, fields: dict, extra: dict) -> None:
    """One batch of a sparse-log-prob candidate (a server) against the reference's recomputed logits."""
    import torch

    device = head.device
    rows = _by_chunks(batch, ref_hidden, head, (*POSITION_FIELDS, "ref_out"),
                      lambda ref_logits, p, q, targets: metrics.compare_sparse(
                          ref_logits, sparse.target[:, p:q].to(device), sparse.ids[:, p:q].to(device),
                          sparse.logprobs[:, p:q].to(device), targets))
    for k in POSITION_FIELDS:
        fields[k].append(rows[k])
    extra["ref_out"].append(rows["ref_out"])
    extra["ambiguous"].append(torch.tensor([float(sparse.ambiguous)]))


def compare_engines(reference, candidate, tokens, cfg: EvalConfig) -> Windows:
    """Two engines in memory on the same windows, no store: the per-position comparison every run makes (for
    tests, benchmarks and notebooks). The reference's head is its own output head."""
    arrays = compare_block(candidate, tokens, reference_arrays(reference, tokens, cfg), reference.head, cfg)
    return Windows({k: v.numpy() for k, v in arrays.items() if k in POSITION_FIELDS or k == "router_agree"},
                   tokens[:, 1:].numpy().astype(np.int32))


@dataclass
class CandidateBlocks:
    """A candidate's blocks in the store: each evaluated once (the engine is built only if one is missing)."""

    spec: EngineSpec
    identity: str
    ref: ReferenceOutputs
    make_engine: object
    limits: Limits | None = None  # the engine's build limits (part of every block's key)
    cost: object = None  # block -> work() dict for the cost record
    engine: object = None
    forward_batches: int = 0
    built: int = 0

    def key(self, b: int) -> str:
        """The store key of block b: candidate identity, reference, block, engine limits, device arch, dtype,
        metric formulas and versions."""
        return self.ref.store.key("evaluate", engine=self.spec.name, candidate=self.identity,
                                  reference=self.ref.base_key, block=b, limits=self.limits.describe(),
                                  device=self.ref.ctx.device.arch, dtype=str(self.ref.ctx.dtype),
                                  metrics=metrics.FORMULA_VERSION, versions=versions())

    def block(self, b: int) -> dict:
        """Block b's per-position arrays (and generations for block 0), loaded or computed once; the engine is
        built at the first block to compute."""
        from safetensors.torch import load_file, save_file

        lo, hi = self.ref.span(b)

        def build(out: Path) -> Built:
            start = time.time()
            ref_block, head = self.ref.block(b), self.ref.head()  # the reference's time is its own
            if self.engine is None:
                self.engine = self.make_engine()
            upstream = time.time() - start
            before = self.engine.forward_batches
            prompts = _prompts(self.ref.evalset, self.ref.cfg) if b == 0 else None
            arrays = compare_block(self.engine, self.ref.evalset.tokens[lo:hi], ref_block, head, self.ref.cfg, prompts)
            save_file({k: v.contiguous() for k, v in arrays.items()}, str(out / CAND_FILE))
            self.forward_batches += self.engine.forward_batches - before
            self.built += 1
            return Built({"engine": self.spec.name, "windows": hi - lo, "seconds": round(time.time() - start, 2),
                          "upstream_seconds": round(upstream, 3)})

        art, built = self.ref.store.get_or_build("evaluate", self.key(b), build,
                                                 {"data": self.ref.evalset.fingerprint, "block": [lo, hi],
                                                  "versions": versions()},
                                                 describe=f"{self.spec.name} windows {lo + 1}-{hi}",
                                                 cost=self.cost(hi - lo) if self.cost else None)
        if built is not None:  # logged once the block is stored: a run killed after this line keeps it
            log.info("  %s windows %d-%d of %d (%.1f s)", self.spec.name, lo + 1, hi, self.ref.evalset.num_windows,
                     built.info["seconds"])
        return load_file(str(art.path / CAND_FILE))

    def windows(self, n: int) -> tuple[Windows, tuple | None]:
        """Per-position arrays of the first n windows, and block 0's generations (reference, candidate)."""
        blocks = [self.block(b) for b in range(math.ceil(n / self.ref.block_windows))]
        keys = list(POSITION_FIELDS) + (["router_agree"] if "router_agree" in blocks[0] else [])
        arrays = {k: np.concatenate([blk[k].numpy() for blk in blocks])[:n] for k in keys}
        evalset = self.ref.evalset
        targets = evalset.tokens[:n, 1:].numpy().astype(np.int32)
        gen = (blocks[0]["gen_ref"], blocks[0]["gen"]) if "gen" in blocks[0] else None
        labels = (evalset.info.get("documents") or {}).get("labels")
        return Windows(arrays, targets, evalset.docs, labels, evalset.positions), gen

    def close(self) -> None:
        """Release the candidate engine if one was built."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _generation_record(prompts, ref_gen, cand_gen, n: int, tokenizer) -> dict:
    def text(ids):
        ids = [i for i in ids if i >= 0]  # a server's generated token it could not name (engines.served): -1
        if tokenizer is None:
            return " ".join(map(str, ids))
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    rows = []
    for p, r, c in zip(prompts.tolist(), ref_gen.tolist(), cand_gen.tolist(), strict=True):
        d = metrics.first_divergence(r, c)
        rows.append({"prompt": text(p), "reference": text(r), "candidate": text(c), "first_divergence": d,
                     "reference_common": text(r[:d]), "reference_rest": text(r[d:]), "candidate_rest": text(c[d:])})
    return {"new_tokens": n, "first_divergence": [row["first_divergence"] for row in rows], "samples": rows}


def result_of(name: str, w: Windows, gen: dict | None) -> EvalResult:
    """Metrics, panel and buckets of the windows a candidate was evaluated on."""
    windows = {"n_pred": int(w.t), "nll_reference": w.per_window("nll_ref").tolist(),
               "nll_candidate": w.per_window("nll_cand").tolist(), "dnll": w.per_window("dnll").tolist(),
               "top1_agreement": w.per_window("agree").tolist(), "kl_mean": w.per_window("kl").tolist()}
    if w.docs is not None:  # the windows' documents (the gate's clusters) and their indices in the text
        windows["document"] = [int(x) for x in w.docs]
        windows["position"] = [int(x) for x in w.positions] if w.positions is not None else None
    positions = {"top1_agreement": (w.a["argmax_cand"] == w.a["argmax_ref"]).mean(0).tolist(),
                 "kl_mean": w.a["kl"].mean(0).tolist(), "dp_true": w.a["dp_true"].mean(0).tolist()}
    return EvalResult(name, metrics.summarize(w, gen), windows, positions, metrics.behaviour(w), metrics.buckets(w),
                      w.a["kl"].ravel(), gen, w.a["argmax_cand"], w)


class _Pace:
    """The evaluation's measured pace: seconds per window of the looks that computed (reused blocks cost nothing),
    and the time left if the run reads every window up to the cap (a passing run reads them all, or nearly: the
    tail checks cannot pass before their windows are in; a failing one may stop earlier)."""

    def __init__(self, cap: int):
        self.cap, self.done, self.windows, self.seconds = cap, 0, 0, 0.0

    def looked(self, n: int, seconds: float, computed: bool) -> None:
        if computed and n > self.done:
            self.windows, self.seconds = self.windows + n - self.done, self.seconds + seconds
        self.done = max(self.done, n)

    def left(self) -> float | None:
        if not self.windows:
            return None
        return self.seconds / self.windows * max(0, self.cap - self.done)

    def outlook(self, _now: float) -> str:
        left = self.left()
        if left is None or self.done >= self.cap:
            return ""
        return (f"; evaluation: {self.done}/{self.cap} windows, ~{progress.duration(left)} left if it reads all "
                f"(measured {self.seconds / self.windows:.2g} s a window)")


def run_sequential(blocks: CandidateBlocks, thresholds, design, gen_prompts, tokenizer, fixed_n: int | None = None):
    """Take looks until every check is decided (or the cap); fixed_n: evaluate exactly that many windows."""
    from quantlab.gate import checks as gate_checks

    start = time.time()
    looks = [(design.look_of(fixed_n), fixed_n)] if fixed_n else list(enumerate(design.looks))
    found, look = [], 0
    pace = _Pace(fixed_n or design.cap)
    outer = progress.current()
    if outer is not None:  # the evaluation step's line, and those of the blocks inside it, say what is left
        outer.eta = lambda _t, now: pace.left()
        outer.outlook = pace.outlook
    for look, n in looks:
        t0, built = time.time(), blocks.built
        w, generated = blocks.windows(n)
        pace.looked(n, time.time() - t0, blocks.built > built)
        if look == looks[0][0] and thresholds is not None:
            check_served_noise(blocks.block(0), thresholds)
        gen = None
        if generated is not None:
            gen = _generation_record(gen_prompts, *generated, blocks.ref.cfg.gen_tokens, tokenizer)
        found = gate_checks.evaluate_checks(thresholds, w, gen, design, look) if thresholds is not None else []
        log.info("look %d/%d at %d windows: %s", look + 1, len(design.looks), n,
                 ", ".join(f"{c.name} {c.verdict}" for c in found) or "no checks")
        if fixed_n or gate_checks.settled(found):
            break
    found = gate_checks.finish(found, at_cap=look == len(design.looks) - 1)
    result = result_of(blocks.spec.name, w, gen)
    result.checks, result.look, result.design = found, look, design
    result.forward_batches, result.computed_now = blocks.forward_batches, blocks.built > 0
    result.seconds = round(time.time() - start, 2)
    return result


def check_served_noise(block: dict, thresholds) -> None:
    """A served candidate's own noise against the gate: window 1 sent twice moved a target log-prob by up to d, so
    the server's perplexity of one run is only known to a factor exp(d); a ppl_ratio bound nearer to 1 than that
    decides on the server's noise, not on the checkpoint, and is refused (exit 2) with the bound it needs. Only
    perplexity: the repeat returns the target's log-prob, not the distributions a KL or top-1 noise would need."""
    if "repeat_max_abs_dlogprob" not in block:
        return
    d = float(block["repeat_max_abs_dlogprob"].max())
    th = thresholds.get("ppl_ratio") if isinstance(thresholds, dict) else None
    if d <= 0 or th is None or th.max is None:
        return
    noise = math.exp(d) - 1
    if th.max - 1 <= noise:
        raise QuantlabError(
            f"gate.thresholds.ppl_ratio.max={th.max:g} is within the server's own noise: window 1 sent twice moved a "
            f"log-prob by up to {d:.3g}, so one run's perplexity is known only to a factor {1 + noise:.4f}",
            fix=f"make the server deterministic (one slot, no batching of requests, a fixed seed), or relax the "
                f"bound above {1 + noise:.4f} (gate.thresholds.ppl_ratio.max=...)")


# ------------------------------------------------------------------------------------------------ numerics
NUMERICS_EPS = 2.0 ** -21  # relative size of the perturbation: a few float32 ulps, what another kernel's sums move
NUMERICS_METRICS = {"top1_agreement": "agree", "ppl_ratio": "dnll", "kl_mean": "kl"}


@contextlib.contextmanager
def perturbed_inputs(model, eps: float = NUMERICS_EPS, seed: int = 0):
    """Every linear layer's input times (1 + e * s_k), s_k a seeded sign per input channel, e = eps or the input
    dtype's own last bit where that is coarser (bfloat16 2^-7, float16 2^-10: 1 + 2^-21 would round to exactly 1
    there and the probe would measure nothing): the last-bit differences another CPU's (or GPU's) matrix kernels
    make, in one place. A quantizer of activations turns some of them into a different rounding, and the metrics
    move by what the run's printed digits cannot hold."""
    import torch

    handles, gen = [], torch.Generator().manual_seed(seed)

    def hook(module, args):
        x = args[0]
        if not torch.is_floating_point(x):
            return None
        signs = module._ql_signs
        if signs.device != x.device or signs.dtype != x.dtype:
            e = max(eps, float(torch.finfo(x.dtype).eps))
            signs = module._ql_signs = (1 + e * module._ql_pm.to(x.device)).to(x.dtype)
        return (x * signs, *args[1:])

    for module in model.modules():
        width = getattr(module, "in_features", None)
        if not isinstance(width, int) or not (isinstance(module, torch.nn.Linear) or type(module).__name__.endswith(
                "Linear")):
            continue
        module._ql_pm = torch.randint(0, 2, (width,), generator=gen).float() * 2 - 1
        module._ql_signs = 1 + eps * module._ql_pm
        handles.append(module.register_forward_pre_hook(hook))
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
        for module in model.modules():
            if hasattr(module, "_ql_signs"):
                del module._ql_signs, module._ql_pm


def numerics_noise(blocks: CandidateBlocks, n_used: int) -> dict:
    """How much of each headline metric is arithmetic, not quantization: block 0's windows evaluated again with
    perturbed_inputs, the per-window differences' spread s, and the spread of the full run's mean another machine
    would print, 3 s / sqrt(n_used) (three standard deviations: windows differ independently in rounding, and s comes
    from one look's windows; measured on the default run, AVX-512 against AVX2 kernels moved top-1 by 0.0026 where
    this says 0.003). Cached
    like every block. {"measured": False, "why": ...} where the engine has no torch model to perturb."""
    from safetensors.torch import load_file, save_file

    lo, hi = blocks.ref.span(0)

    def build(out: Path) -> Built:
        engine = blocks.engine or blocks.make_engine()
        blocks.engine = engine
        target = getattr(engine, "model", None)
        if target is None:
            raise _NoModel()
        start = time.time()
        with perturbed_inputs(target) as n_layers:
            arrays = compare_block(engine, blocks.ref.evalset.tokens[lo:hi], blocks.ref.block(0), blocks.ref.head(),
                                   blocks.ref.cfg)
        save_file({k: v.contiguous() for k, v in arrays.items() if k in POSITION_FIELDS}, str(out / CAND_FILE))
        return Built({"layers": n_layers, "windows": hi - lo, "seconds": round(time.time() - start, 2)})

    try:
        art, _ = blocks.ref.store.get_or_build("evaluate", blocks.ref.store.key(
            "evaluate", numerics=NUMERICS_EPS, block=blocks.key(0)), build, {"block": [lo, hi]},
            describe=f"{blocks.spec.name} windows {lo + 1}-{hi} with last-bit perturbations")
    except _NoModel:
        note = _served_note(blocks.block(0))
        return {"measured": False, "why": f"engine {blocks.spec.name} has no torch model to perturb",
                **({"served": note} if note else {})}
    base, moved = blocks.block(0), load_file(str(art.path / CAND_FILE))
    out = {"measured": True, "eps": NUMERICS_EPS, "windows": hi - lo, "n_used": n_used, "metrics": {}}
    for name, key in NUMERICS_METRICS.items():
        a, b = (_per_window(x, key) for x in (base, moved))
        s = float(np.std(a - b, ddof=1)) if a.size > 1 else 0.0
        spread = 3 * s / math.sqrt(max(n_used, 1))
        if name == "ppl_ratio":  # per-window dNLL: the ratio moves by exp(mean) * spread
            spread *= math.exp(float(np.mean(a)))
        out["metrics"][name] = {"spread": spread, "per_window_sd": s}
    return out


class _NoModel(Exception):
    pass


def _served_note(block: dict) -> str:
    """What a server's block 0 says about its own noise and the KL bound (nothing for other engines)."""
    if "ref_out" not in block:
        return ""
    out = block["ref_out"].double()
    note = (f"Served: perplexity and top-1 are exact; KL is a lower bound from the server's top-k log-probs (the "
            f"reference's mass outside them: mean {float(out.mean()):.2g}, max {float(out.max()):.2g}; "
            "docs/served.md)")
    if "repeat_max_abs_dlogprob" in block:
        note += (f"; the server's own noise, window 1 sent twice: max |Δ log p| "
                 f"{float(block['repeat_max_abs_dlogprob'].max()):.2g}")
    return note + "."


def _per_window(arrays: dict, key: str) -> np.ndarray:
    if key == "agree":
        return (arrays["argmax_cand"] == arrays["argmax_ref"]).double().mean(1).numpy()
    if key == "dnll":
        return (arrays["nll_cand"].double() - arrays["nll_ref"].double()).mean(1).numpy()
    return arrays[key].double().mean(1).numpy()


# ------------------------------------------------------------------------------------------ attribution
def attribution(results: dict, engine: str) -> dict:
    """Split the loss three ways: quantization itself (HF -> fake-quant), export (fake-quant -> fake-quant with
    the transformations export applies), engine numerics (as exported -> the engine running the checkpoint)."""
    chain = ["fakequant", "fakequant_exported", engine]
    steps = {"quantization": (None, "fakequant"), "export": ("fakequant", "fakequant_exported"),
             "engine": ("fakequant_exported", engine)}

    def loss(name, metric):  # how much worse than the reference, in the metric's own units
        return metrics.METRICS[metric].loss(results[name].metrics[metric]["value"])

    out = {}
    for metric in ("dnll_mean", "top1_agreement", "kl_mean"):
        out[metric] = {name: results[name].metrics[metric]["value"] for name in chain}
        for step_name, (a, b) in steps.items():
            out[metric][step_name] = loss(b, metric) - (loss(a, metric) if a else 0.0)

    def agree(a, b):
        return float((results[a].argmax == results[b].argmax).mean())

    return {"engine": engine, "metrics": out,
            "engine_vs_fakequant_top1": agree(engine, "fakequant"),
            "engine_vs_exported_top1": agree(engine, "fakequant_exported"),
            "exported_jitter_floor_top1": agree("fakequant_exported", "fakequant_jitter"),
            "note": "losses vs the reference (top-1 as disagreement 1 - agreement): quantization = fake-quant; "
                    "export = fake-quant after export's re-smoothing minus fake-quant; engine = the engine minus that. "
                    "exported_jitter_floor_top1 = the as-exported model vs itself under input noise of rounding size "
                    "(relative max(1e-6, the compute dtype's eps)): "
                    "the best agreement any implementation that is not bit-identical can reach on this model"}


# ------------------------------------------------------------------------------------------- the steps
def _units(r, tokens: int, what: str, engine: str | None = None) -> dict | None:
    """The work units (quantlab.prior) of the reference's (what="reference": the whole run's, "reference-block": one
    block's) or a candidate's ("run", "block") evaluation of tokens; a whole run adds the generations and, for a
    candidate, the first look again (numerics)."""
    from quantlab import first_run, prior

    shape, cfg = first_run.model(r)[0], r.ctx.cfg
    if shape is None:
        return None
    seq = cfg.eval.seq_len
    whole = what in ("run", "reference")
    prompts = min(cfg.eval.gen_prompts, first_run.eval_windows(r)) if whole and cfg.eval.gen_tokens else 0
    if what.startswith("reference"):
        return prior.reference(shape, tokens, seq, cfg.eval.batch_size, (prompts, cfg.eval.gen_tokens))
    if engine == "served":  # a server's time is its own machine's: nothing here prices it
        return None
    numerics = what == "run" and cfg.eval.numerics and engine == r.ctx.engine.name  # the main engine's only
    look = cfg.gate.statistical.look_windows * seq if numerics else 0
    return prior.evaluation(shape, tokens, seq, cfg.eval.batch_size, look, (prompts, cfg.eval.gen_tokens),
                            r.ctx.precision.weight_bits)


def _params(r) -> int:
    """The model's parameters (quantlab.first_run.model: the declared ones before the conversion)."""
    from quantlab import first_run

    return first_run.model(r)[1]


def _run_tokens(r) -> int:
    """The tokens the plan prices an evaluation at (quantlab.first_run.passing_tokens)."""
    from quantlab import first_run

    return first_run.passing_tokens(r)


def reference_step(ctx: RunContext) -> Step:
    """The reference's outputs: a lazy accessor over cached blocks (built with the reference engine if missing)."""
    cfg = ctx.cfg

    def key_of(r) -> str:
        return reference_key(ctx.store, r.fingerprint("prepare"), r.fingerprint("data:eval"), cfg.eval, ctx.device,
                             ctx.dtype, cfg.gate.statistical.look_windows)

    def load(_art, r, _built) -> ReferenceOutputs:
        evalset, params = r.value("data:eval"), r.value("prepare").num_params
        return ReferenceOutputs(ctx, r.key("reference"), evalset, lambda: build_engine(ENGINES["reference"], r),
                                lambda n: costs.work(costs.device_label(ctx.device), "reference", params,
                                                     n * evalset.seq_len,
                                                     units=_units(r, n * evalset.seq_len, "reference-block")))

    def probe(r) -> tuple[str, str]:
        return "reference", ctx.store.key("reference", base=r.key("reference"), block=0)

    return Step("reference", "evaluate", key_of, load, source="blocks", needs=("prepare", "data:eval"), probe=probe,
                store_stage="reference",
                target=False,
                work=lambda r, tokens=None: costs.work(costs.device_label(ctx.device), "reference", _params(r),
                                                       tokens or _run_tokens(r),
                                                       units=_units(r, tokens or _run_tokens(r), "reference")))


def candidate_identity(spec: EngineSpec, r) -> str:
    """What a candidate's outputs depend on: the exported checkpoint for engines that run it (plus the engine's
    own output-changing options), the calibrated state for fake-quant rungs, the model for the reference."""
    if spec.runs == "checkpoint":
        extra = spec.identity(r.ctx.cfg.engine) if spec.name == r.ctx.engine.name else {}
        return f"{r.fingerprint('export')}:{''.join(str(v) for v in extra.values())}"
    if spec.runs == "model":  # the reference itself, or a server (its identity: URL, model, k, revision)
        extra = spec.identity(r.ctx.cfg.engine) if spec.name == r.ctx.engine.name else {}
        return r.fingerprint("prepare") + "".join(f":{v}" for v in extra.values())
    return r.key("quantize")


def candidate_step(ctx: RunContext, spec: EngineSpec) -> Step:
    """One candidate evaluated look by look. The engine under test is gated; the attribution rungs are evaluated on
    exactly the windows it used."""
    from quantlab.gate import checks as gate_checks

    cfg = ctx.cfg
    main = f"evaluate:{ctx.engine.name}"
    is_main = spec.name == ctx.engine.name

    def blocks(r) -> CandidateBlocks:
        from quantlab.stages.quantize import recipe_label

        memo = ctx.memo.setdefault("candidate_blocks", {})
        if spec.name not in memo:
            evalset, params = r.value("data:eval"), r.value("prepare").num_params
            memo[spec.name] = CandidateBlocks(
                spec, candidate_identity(spec, r), r.value("reference"), lambda: build_engine(spec, r), limits(r),
                lambda n: costs.work(costs.device_label(ctx.device), f"{spec.name}:{recipe_label(ctx)}", params,
                                     n * evalset.seq_len, units=_units(r, n * evalset.seq_len, "block", spec.name)))
        return memo[spec.name]

    def build(_out, r) -> EvalResult:
        from quantlab.models import load_tokenizer

        evalset = r.value("data:eval")
        thresholds = gate_checks.thresholds_for(cfg.gate, ctx.precision.name, cfg.eval.seq_len) if is_main else None
        design = gate_checks.design_for(cfg.gate, evalset.num_windows, cfg.eval.max_windows)
        if is_main:
            design = gate_checks.with_tails(design, thresholds)
        warnings = []
        if is_main:  # exit 2 before any evaluation (the pipeline checked it before calibration already)
            warnings = gate_checks.check_evaluation_text(cfg.gate, ctx.precision.name, evalset, cfg.eval.max_windows)
        fixed = None if is_main else r.value(main).design.looks[r.value(main).look]
        log.info("evaluate: %s vs reference, looks of %d windows up to %d x %d tokens", spec.name,
                 cfg.gate.statistical.look_windows, design.cap, evalset.seq_len)
        cand = blocks(r)
        try:
            result = run_sequential(cand, thresholds, design, _prompts(evalset, cfg.eval),
                                    load_tokenizer(r.value("prepare")), fixed)
            if is_main and cfg.eval.numerics:
                result.numerics = numerics_noise(cand, result.design.looks[result.look])
        finally:
            cand.close()
        result.warnings = warnings
        return result

    def probe(r) -> tuple[str, str]:
        ref = ReferenceOutputs(ctx, r.key("reference"), None, None)
        cand = CandidateBlocks(spec, candidate_identity(spec, r), ref, None, limits(r))
        return "evaluate", cand.key(0)

    def work(r, tokens: int | None = None) -> dict:
        """The work of evaluating a passing run's tokens (the plan's figure), or of `tokens` (the windows a run
        read: what the plan is compared with afterwards, quantlab.pipeline.plan_vs_actual)."""
        from quantlab.stages.quantize import recipe_label

        tokens = tokens or _run_tokens(r)
        return costs.work(costs.device_label(ctx.device), f"{spec.name}:{recipe_label(ctx)}", _params(r),
                          tokens, units=_units(r, tokens, "run", spec.name))

    needs = ("reference", "data:eval", "prepare", RUNS_NEEDS[spec.runs]) + (() if is_main else (main,))
    return Step(f"evaluate:{spec.name}", "evaluate", lambda r: None, lambda art, r, built: built, build, needs=needs,
                work=work, probe=probe, describe=f"{spec.name} evaluation")
