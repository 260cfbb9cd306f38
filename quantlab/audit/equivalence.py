"""Equivalence transforms: a checkpoint whose layers differ from the reference's by a transform that leaves what the
block computes unchanged, told apart from a fault.

A smoothing scale moved between two linear layers (AWQ / SmoothQuant mappings such as v_proj -> o_proj and
up_proj -> down_proj, in llm-compressor's and AutoAWQ's recipes) divides the producer's output rows by s and
multiplies the consumer's input columns by s. Through attention (each head's output is a weighted sum of its value
rows) and through the gated product act(gate) * up, a per-channel factor passes unchanged, so the pair computes the
reference's function. With grouped-query attention a value row feeds one input column of o_proj per query head of
its group (row kv * head_dim + d -> columns q * head_dim + d for the heads q of group kv).

For every such pair of a block the audit fits, on the dequantized weights against the reference (in the space the
layer was quantized in: after the norm fold that feeds it), the factor of each producer row and of each consumer
column. A side is scaled when the robust spread of its log factors is several times the quantizer's own noise
(the smallest of the producer's, the consumer's and their product's spreads; _classify). Neither side scaled:
nothing to explain. Both sides scaled by reciprocal factors (the log of their product within the format's
column-spread bound of 0, robustly): the transform is accepted, both layers are compared with the reference
through it (the per-layer bounds still apply), and a finding names it. Anything else is a fault named
by its pair: a scale applied to one side only, factors that are not reciprocal, or the inverse factors found on a
layer that does not feed the consumer linearly (gate_proj: SiLU does not pass a scale).

Rotations are not inferred here. compressed-tensors' transform_config declares them, and the checkpoint is refused
when it is opened (quantlab.formats.compressed_tensors), naming the transform: online ones (SpinQuant R3 / R4,
QuIP's input / output Hadamards: applied to activations at run time) because quantlab's engine does not apply them;
offline ones (SpinQuant R1 / R2, QuaRot: fused into the weights) because this audit would compare every rotated
layer with the unrotated reference and call it a fault."""
from __future__ import annotations

import math

from quantlab.audit.bounds import weight_bounds
from quantlab.audit.report import ERROR, INFO

# (producer suffix, consumer suffix, what passes the scale): the pairs whose scale is exact for the block
PAIRS = (("self_attn.v_proj", "self_attn.o_proj", "attention"), ("mlp.up_proj", "mlp.down_proj", "gated product"))
NONLINEAR = {"mlp.down_proj": ("mlp.gate_proj", "SiLU / GELU of gate_proj's output does not pass a scale"),
             "self_attn.o_proj": ("self_attn.q_proj", "q_proj's output enters the softmax, not the weighted sum")}
MISMATCH_MEDIAN = math.log(1.05)  # the two sides' factors may disagree by at most this in the median (a gain)
SIDE_SIGNAL = 3.0  # a side carries factors when their log spread is 3x what the quantizer leaves ...
SIDE_FLOOR = 0.02  # ... and above 0.02 (2%): unsmoothed int4 pairs of the default model show 0.003-0.006
HEALTHY_MARGIN = 1.5  # the formats' column-spread warnings sit at 1.5x the worst healthy spread (precisions.py)
ACCEPTED = "equivalence transforms accepted"  # how the info finding naming them starts (kept in run.json)


def named_in_run(finding) -> bool:
    """Whether an info finding is one the run's record and report keep beside the errors and warnings: the
    equivalence transforms the audit accepted (what the checkpoint's layers were compared through)."""
    return finding.severity == INFO and finding.message.startswith(ACCEPTED)


def held_suffixes() -> set[str]:
    """Module suffixes whose dequantized weights the pair analysis needs (producers, consumers, the layers a
    misplaced inverse is looked for on)."""
    out = {s for p, c, _ in PAIRS for s in (p, c)}
    return out | {p for p, _ in NONLINEAR.values()}


def wanted(module: str) -> bool:
    """Whether `module` takes part in the pair analysis."""
    return any(module.endswith("." + s) for s in held_suffixes())


def _factors(ref, deq, dim: int):
    """Per-row (dim=1: sums over each row) or per-column (dim=0) factor f with deq ~ f * ref, and where it is
    defined (the reference holds real weight there)."""
    import torch

    rr = (ref * ref).sum(dim)
    rd = (ref * deq).sum(dim)
    ok = (rr > 1e-6 * float(rr.median().clamp_min(1e-30))) & (rd > 0)
    f = torch.where(ok, rd / torch.where(ok, rr, torch.ones_like(rr)), torch.ones_like(rr))
    return f, ok


def _spread(x, ok) -> float:
    """Robust spread (1.4826 x median absolute deviation) of x where ok."""
    v = x[ok]
    if v.numel() < 2:
        return 0.0
    return float(1.4826 * (v - v.median()).abs().median())


def _head_map(a, rows: int, cols: int):
    """For each consumer input column, the producer output row that feeds it (None: the shapes do not map)."""
    import torch

    if rows == cols:
        return torch.arange(cols)
    cfg = a.config.get("text_config") if isinstance(a.config.get("text_config"), dict) else a.config
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if not (isinstance(heads, int) and isinstance(kv, int) and heads > 0 and kv > 0 and heads % kv == 0):
        return None
    head_dim = cfg.get("head_dim") or (cols // heads)
    if head_dim * heads != cols or head_dim * kv != rows:
        return None
    j = torch.arange(cols)
    return (j // head_dim // (heads // kv)) * head_dim + j % head_dim


def _best_space(candidates, deq, dim: int):
    """The reference in the space the layer was quantized in (no fold, or one of its fold candidates: the norm that
    feeds it), chosen by the error left after fitting the free factors along `dim` (rows: dim=1)."""
    best = None
    for fold, ref in candidates:
        f, _ = _factors(ref, deq, dim)
        fitted = ref * (f[:, None] if dim == 1 else f[None, :])
        err = float(((deq - fitted) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, fold, ref)
    return best[1], best[2]


def _classify(sp_r: float, sp_c: float, mismatch: float, median: float, b) -> str | None:
    """What a pair's three robust log spreads say: of the producer's row factors (sp_r), of the consumer's column
    factors (sp_c) and of their product (mismatch: the quantizer's noise alone when the two are reciprocal).
    The quantizer's noise is the smallest of the three; a side carries factors when its spread is SIDE_SIGNAL times
    that and above SIDE_FLOOR. "accepted": both sides do and their product is within the format's column-spread
    bound of 1 (median within MISMATCH_MEDIAN); None: neither side does; else the fault ("producer only",
    "consumer only", or "not reciprocal": both sides beyond the format's column-spread warning, their product not
    1)."""
    reciprocal = mismatch <= b.column_spread_error and abs(median) <= MISMATCH_MEDIAN
    noise = min(sp_r, sp_c, mismatch)
    rows_scaled = sp_r > max(SIDE_SIGNAL * noise, SIDE_FLOOR)
    cols_scaled = sp_c > max(SIDE_SIGNAL * noise, SIDE_FLOOR)
    if rows_scaled and cols_scaled:
        return "accepted" if reciprocal else "not reciprocal"
    if rows_scaled != cols_scaled:
        # one side alone is a fault only beyond what the format's healthy exports show per channel (its column-spread
        # warning is 1.5x the worst healthy spread): a healthy SmoothQuant down_proj shows 0.046 with nothing moved
        if (sp_r if rows_scaled else sp_c) <= b.column_spread_warn / HEALTHY_MARGIN:
            return None
        return "producer only" if rows_scaled else "consumer only"
    if not reciprocal and min(sp_r, sp_c) > b.column_spread_warn:
        return "not reciprocal"
    return None


class PairAnalysis:
    """The smoothing pairs of one audit: per block the held layers are analysed once the block is complete; the
    accepted transforms and the faults are reported at the end (grouped by kind)."""

    def __init__(self, a):
        self.a = a
        self.accepted: list[dict] = []
        self.faults: dict[str, list[dict]] = {}
        self.seen: dict[tuple[str, str], dict] = {}  # (producer suffix, consumer suffix) -> blocks, widths differ

    def block(self, held: dict, rows: dict) -> None:
        """Analyse one block: held maps module -> (candidates [(fold name, reference in that space)], dequantized
        weight); rows maps module -> its weights row (updated in place for an accepted transform)."""
        for prod_s, cons_s, through in PAIRS:
            prod = next((m for m in held if m.endswith("." + prod_s)), None)
            if prod is None:
                continue
            cons = prod[: -len(prod_s)] + cons_s
            if cons not in held or prod not in rows or cons not in rows:
                continue
            seen = self.seen.setdefault((prod_s, cons_s), {"blocks": 0, "widths_differ": False})
            seen["blocks"] += 1
            seen["widths_differ"] |= held[prod][1].shape[0] != held[cons][1].shape[1]
            self._pair(prod, cons, through, held, rows)

    def _pair(self, prod: str, cons: str, through: str, held: dict, rows: dict) -> None:
        import torch

        (p_cands, p_deq), (c_cands, c_deq) = held[prod], held[cons]
        mapping = _head_map(self.a, p_deq.shape[0], c_deq.shape[1])
        if mapping is None:
            return
        mapping = mapping.to(p_deq.device)  # the layers are on the audit's device (a GPU where there is one)
        p_fold, p_ref = _best_space(p_cands, p_deq, 1)
        c_ref = c_cands[0][1]  # the consumer's own space (plain, or after its pre_quant_scale): a norm does not feed it
        r, r_ok = _factors(p_ref, p_deq, 1)
        c, c_ok = _factors(c_ref, c_deq, 0)
        lr, lc = torch.log(r), torch.log(c)
        b = weight_bounds(rows[cons]["format"])
        sp_r, sp_c = _spread(lr, r_ok), _spread(lc, c_ok)
        ok = c_ok & r_ok[mapping]
        m = lr[mapping] + lc
        mismatch = float(1.4826 * m[ok].abs().median()) if int(ok.sum()) else math.inf
        median = float(m[ok].median()) if int(ok.sum()) else math.inf
        pair = {"producer": prod, "consumer": cons, "through": through, "spread_producer": round(sp_r, 4),
                "spread_consumer": round(sp_c, 4), "mismatch": round(mismatch, 4)}
        kind = _classify(sp_r, sp_c, mismatch, median, b)
        if kind is None:
            return  # neither side carries per-channel factors beyond the quantizer's noise: the plain comparison stands
        if kind == "accepted":
            self._accept(pair, (p_fold, p_ref, p_deq, lr, r_ok), (c_ref, c_deq, lc, c_ok), mapping, rows)
            return
        if kind == "consumer only":
            other = self._misplaced(cons, held, lc, c_ok, b)
            if other:
                kind, pair["other"], pair["why"] = "wrong producer", other[0], other[1]
        self.faults.setdefault(kind, []).append(pair)

    def _misplaced(self, cons: str, held: dict, lc, c_ok, b):
        """The layer of the block whose output rows carry the inverse of the consumer's column factors although it
        does not feed the consumer linearly, with why; None when there is none."""
        import torch

        suffix = next((s for s in NONLINEAR if cons.endswith("." + s)), None)
        if suffix is None:
            return None
        other_s, why = NONLINEAR[suffix]
        other = cons[: -len(suffix)] + other_s
        if other not in held:
            return None
        cands, deq = held[other]
        mapping = _head_map(self.a, deq.shape[0], lc.shape[0])
        if mapping is None:
            return None
        mapping = mapping.to(deq.device)
        _, ref = _best_space(cands, deq, 1)
        r, r_ok = _factors(ref, deq, 1)
        ok = c_ok & r_ok[mapping]
        lr = torch.log(r)
        m = lr[mapping] + lc
        if not int(ok.sum()):
            return None
        # the other layer's rows must carry factors of their own, and the inverse of the consumer's far more closely
        # than the consumer's factors spread (unscaled rows "match" any small column spread)
        mismatch, sp_o, sp_c = float(1.4826 * m[ok].abs().median()), _spread(lr, r_ok), _spread(lc, c_ok)
        scaled = sp_o > max(SIDE_FLOOR, b.column_spread_warn / HEALTHY_MARGIN)
        return (other, why) if scaled and mismatch <= b.column_spread_error and SIDE_SIGNAL * mismatch <= sp_c \
            else None

    def _accept(self, pair: dict, p, c, mapping, rows: dict) -> None:
        """Both layers compared with the reference through the joint scale s (log s: the mean of what each side
        says, -log r on the producer's rows, log c on the consumer's columns)."""
        import torch

        from quantlab.audit.weight_stats import weight_stats as _weight_stats

        p_fold, p_ref, p_deq, lr, r_ok = p
        c_ref, c_deq, lc, c_ok = c
        from_r = torch.where(r_ok, -lr, torch.zeros_like(lr))[mapping]
        count = c_ok.float() + r_ok[mapping].float()
        log_s = torch.where(count > 0, (torch.where(c_ok, lc, torch.zeros_like(lc)) + from_r) /
                            count.clamp_min(1), torch.zeros_like(lc))
        per_row = torch.zeros_like(lr).index_add_(0, mapping, log_s)
        hits = torch.zeros_like(lr).index_add_(0, mapping, torch.ones_like(log_s)).clamp_min(1)
        s_rows, s_cols = torch.exp(per_row / hits), torch.exp(log_s)
        name = f"smoothing {pair['producer']} -> {pair['consumer']}"
        for module, ref, deq in ((pair["producer"], p_ref / s_rows[:, None], p_deq),
                                 (pair["consumer"], c_ref * s_cols[None, :], c_deq)):
            rows[module].update(_weight_stats(ref, deq))
            rows[module]["transform"] = name
        if p_fold and p_fold != "pre_quant_scale":
            rows[pair["producer"]]["fold"] = p_fold
            self.a.folded.add(p_fold)
        self._bias(pair["producer"], s_rows)
        pair["factors"] = (round(float(s_cols.min()), 4), round(float(s_cols.max()), 4))
        self.accepted.append(pair)

    def _bias(self, producer: str, s_rows) -> None:
        """A producer's bias is divided by the same s: credited (the tensors check reports it as explained) when it
        is the reference's bias / s."""
        name = f"{producer}.bias"
        ref = self.a.ref_tensor(name)
        if ref is None or name not in self.a.t:
            return
        ours, expect = self.a.t.get(name).float(), ref.float() / s_rows.to(ref.device)
        if float((ours - expect).norm()) <= 1e-3 * float(expect.norm().clamp_min(1e-30)):
            self.a.folded.add(name)

    def report(self) -> None:
        """One info finding naming the accepted transforms; one error per kind of fault, naming the pairs."""
        a = self.a
        if self.accepted:
            kinds: dict[str, list[dict]] = {}
            for p in self.accepted:
                key = f"{p['producer'].rpartition('.')[2]} -> {p['consumer'].rpartition('.')[2]}"
                kinds.setdefault(key, []).append(p)
            parts = []
            for key, pairs in kinds.items():
                lo = min(p["factors"][0] for p in pairs)
                hi = max(p["factors"][1] for p in pairs)
                worst = max(p["mismatch"] for p in pairs)
                parts.append(f"{key} in {len(pairs)} block(s) (per-channel factors {lo:.3g}-{hi:.3g}, the two "
                             f"sides reciprocal within a log spread of {worst:.3g})")
            a.add(INFO, "weights", [m for p in self.accepted for m in (p["producer"], p["consumer"])],
                  f"{ACCEPTED}: smoothing scales moved between linear layers, "
                  + "; ".join(parts) + f"{self._declared()}: each pair computes the reference's function, and its "
                  "layers were compared with the reference through the scale")
        self._unapplied()
        texts = {
            "producer only": ("output rows are scaled per channel but the consumer's input columns do not carry the "
                              "inverse", "a smoothing applied to one side only (the consumer's multiplication lost "
                              "or undone)"),
            "consumer only": ("input columns are scaled per channel but the producer's output rows do not carry the "
                              "inverse", "a smoothing applied to one side only (the producer's division lost or "
                              "undone)"),
            "wrong producer": ("input columns are scaled per channel and the inverse sits on a layer that does not "
                               "feed them linearly", "a smoothing mapped onto the wrong producer"),
            "not reciprocal": ("both sides are scaled per channel, but not by reciprocal factors",
                               "the two sides of a smoothing come from different calibrations or layers"),
        }
        for kind, pairs in self.faults.items():
            what, cause = texts[kind]
            shown = "; ".join(self._describe(p) for p in pairs[:3]) + (
                f" (and {len(pairs) - 3} more)" if len(pairs) > 3 else "")
            a.add(ERROR, "weights", [m for p in pairs for m in (p["producer"], p["consumer"], p.get("other", ""))
                                     if m],
                  f"{len(pairs)} smoothing pair(s) whose {what}: {shown}", cause,
                  consequence=("every engine runs the pair with each channel off by its smoothing factor: the block "
                               "no longer computes the reference's function"),
                  fix="re-export from a model where both sides of every smoothing were applied (or neither)")

    @staticmethod
    def _describe(p: dict) -> str:
        text = (f"{p['producer']} -> {p['consumer']} (per-channel log spread: producer rows {p['spread_producer']:.3g},"
                f" consumer columns {p['spread_consumer']:.3g}, of their product {p['mismatch']:.3g})")
        if p.get("other"):
            text += f", the inverse on {p['other']}'s rows ({p['why']})"
        return text

    def _unapplied(self) -> None:
        """An info finding for each pair the recipe declares whose factors no block carries (both layers compared
        plainly, as for any layer)."""
        from quantlab.formats.compressed_tensors import recipe_mappings

        found = {(p["producer"].rpartition(".")[2], p["consumer"].rpartition(".")[2])
                 for p in self.accepted + [q for qs in self.faults.values() for q in qs]}
        mappings = recipe_mappings(self.a.ckpt)
        for (prod_s, cons_s), seen in self.seen.items():
            key = (prod_s.rpartition(".")[2], cons_s.rpartition(".")[2])
            declared = [f"{p} -> {', '.join(c)}" for p, c in mappings
                        if _matches(p, "x." + prod_s) and any(_matches(t, "x." + cons_s) for t in c)]
            if key in found or not declared:
                continue
            why = (" (their widths differ, as grouped-query attention makes v_proj's output narrower than o_proj's "
                   "input: llm-compressor skips such a mapping)" if seen["widths_differ"] else "")
            self.a.add(INFO, "weights", [], f"the checkpoint's recipe.yaml declares the smoothing {declared[0]}, but "
                       f"none of the {seen['blocks']} {key[0]} -> {key[1]} pair(s) carries per-channel factors{why}: "
                       "those layers were compared with the reference as they are")

    def _declared(self) -> str:
        from quantlab.formats.compressed_tensors import recipe_mappings

        mappings = [f"{p} -> {', '.join(c)}" for p, c in recipe_mappings(self.a.ckpt)]
        if not mappings:
            return ", inferred from the weights (no recipe declares them)"
        return f", as the checkpoint's recipe.yaml declares ({'; '.join(mappings[:4])})"


def _matches(pattern: str, name: str) -> bool:
    """llm-compressor's target syntax: "re:" and a regular expression searched in the module name, else the name's
    last components."""
    import re

    if pattern.startswith("re:"):
        try:
            return re.search(pattern[3:], name) is not None
        except re.error:
            return False
    return name == pattern or name.endswith("." + pattern)
