"""The default text: the documentation topics one Python release ships, packaged with quantlab, cut into distinct
documents and into a calibration part and an evaluation part that share no text (quantlab.stages.data reads it)."""
from __future__ import annotations

import functools
import json
from typing import Iterator

# The default text's documents and parts (_pydoc_groups): pydoc's topics nest (`compound` holds `if`, `while`,
# `class`, ...; `typesseq` holds `typesseq-mutable`), so topics sharing a paragraph of PYDOC_SHARED_CHARS or more are
# one group, held by one part, and a topic with half its paragraph text inside a longer topic of its group is left out
# (57 distinct documents of 79 topics). Evaluation: the groups whose longest topic has PYDOC_EVAL_CHARS characters
# (SmolLM2: 70 windows of 512 tokens, 26 documents holding windows, Satterthwaite df 6.5); calibration: every topic
# of the other groups, nested ones included, the longest topics among them (SmolLM2: 73.6k tokens, 143 windows of
# 512, 35 of 2048; the hash split gave 81.7k). Until 2026-12-07 the parts were cut by a hash of the name (80%
# calibration): 61 windows held by 10 topics, two of them the same text, df 2.9, and 2.5% of the evaluation text in
# calibration too.
PYDOC_EVAL_CHARS = (400, 22_000)
PYDOC_SHARED_CHARS = 120


PYDOC_SNAPSHOT = "pydoc_topics.json.gz"


@functools.lru_cache(maxsize=1)
def pydoc_topics() -> dict[str, str]:
    """The default text: the documentation topics one Python release ships (pydoc_data.topics of CPython 3.11.7),
    packaged with quantlab as calib_data/pydoc_topics.json.gz, so that the default calibration, evaluation, canary
    and the test models are the same text under every Python (3.12's module has other topics and other text: the
    default run's documents, windows and metrics moved with the interpreter)."""
    import gzip

    from quantlab.config import calib_data_dir

    with gzip.open(calib_data_dir() / PYDOC_SNAPSHOT, "rt", encoding="utf-8") as f:
        return json.load(f)["topics"]


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) >= PYDOC_SHARED_CHARS]


@functools.lru_cache(maxsize=1)
def _pydoc_groups() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The packaged topics' groups (longest topic -> (its topics, its documents), longest first): topics sharing a
    paragraph are one group; a topic whose paragraphs lie half (by characters) in a longer topic of its group is not
    a document of its own."""
    topics = {name: text.strip() for name, text in pydoc_topics().items()}
    paras = {name: _paragraphs(text) for name, text in topics.items()}
    parent = {name: name for name in topics}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    owner: dict[str, str] = {}
    for name in sorted(topics):
        for para in paras[name]:
            if para in owner:
                parent[root(name)] = root(owner[para])
            else:
                owner[para] = name
    members: dict[str, list[str]] = {}
    for name in sorted(topics):
        members.setdefault(root(name), []).append(name)

    def inside(name: str, other: str) -> float:
        theirs = set(paras[other])
        return sum(len(p) for p in paras[name] if p in theirs) / max(1, sum(len(p) for p in paras[name]))

    groups = {}
    for names in members.values():
        names.sort(key=lambda n: (-len(topics[n]), n))
        documents = [n for i, n in enumerate(names) if not any(inside(n, o) >= 0.5 for o in names[:i])]
        groups[names[0]] = (tuple(names), tuple(documents))
    return groups


def _pydoc_names(role) -> list[str]:
    """The role's topics in name order: evaluation the documents of the groups whose longest topic has
    PYDOC_EVAL_CHARS characters (each text once: the gate's documents), calibration every topic of the other groups
    (nested topics too, as before the grouping: calibration samples windows of text, and the 32 x 2048-token windows
    ModelOpt's examples calibrate with need about 65k tokens). No text is in both."""
    topics = pydoc_topics()
    low, high = PYDOC_EVAL_CHARS
    names = []
    for longest, (members, documents) in _pydoc_groups().items():
        evaluated = low <= len(topics[longest].strip()) < high
        if evaluated != role.sampled:
            names += documents if evaluated else members
    return sorted(names)


def _pydoc_docs(role) -> Iterator[tuple[str, str]]:
    """(topic text, topic name) of the role's part of the packaged pydoc topics, in name order."""
    topics = pydoc_topics()

    for name in _pydoc_names(role):
        yield topics[name].strip(), name
