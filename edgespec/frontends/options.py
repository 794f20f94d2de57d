"""Each command's options as a frozen dataclass, built once from the parsed command line by
`options(ns)`, the one place that maps argparse's Namespace onto them (cli.py declares the flags,
their defaults and help). The commands take these, never the Namespace.

The groups several commands share mirror cli.py's argument groups: `ModelOptions` (models and
hardware), `DraftOptions` (speculative decoding's settings), `SamplingOptions`, `GrammarOptions`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class ModelOptions:
    """-m, -md, -c, -t, -td, -ngl, -ngld, the KV cache types, --rpc, --rpc-draft, --exactness,
    --exact-kernels."""

    model: str
    draft: str | None  # -md as given; "none": none (cli._draft_spec decides the one used)
    n_ctx: int
    threads: int
    threads_draft: int
    ngl: int
    ngld: int
    kv_type: str | None
    cache_type_k: str | None
    cache_type_v: str | None
    rpc: str | None
    rpc_draft: str | None
    exactness: str
    exact_kernels: bool


@dataclass(frozen=True)
class DraftOptions:
    """How drafts are made: --spec-draft-n-max/-min/-p-min, --pearl-gamma, --lookahead-cache,
    --heads. The defaults are the flags' own: what a command without these flags (doctor) runs with."""

    draft_n_max: int = 16
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    pearl_gamma: int = 4
    lookahead_cache: str | None = None
    heads: str | None = None


@dataclass(frozen=True)
class SamplingOptions:
    temp: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None


@dataclass(frozen=True)
class GrammarOptions:
    grammar_file: str | None = None
    json_schema: str | None = None


@dataclass(frozen=True)
class _Decoding:
    """What every command that generates text shares: the method (--spec), the models, how
    drafts are made, the sampling flags."""

    spec: str
    models: ModelOptions
    drafting: DraftOptions
    sampling: SamplingOptions


@dataclass(frozen=True)
class _Constrained(_Decoding):
    grammar: GrammarOptions  # --grammar-file / --json-schema


@dataclass(frozen=True)
class RunOptions(_Constrained):
    prompt: str | None
    file: str | None
    n_predict: int
    raw: bool
    system: str | None
    json: bool


@dataclass(frozen=True)
class ChatOptions(_Constrained):
    n_predict: int
    system: str | None
    reuse: bool
    history: bool = True  # the user's past replies as a drafting source (--no-history: off)


@dataclass(frozen=True)
class BatchOptions(_Constrained):
    input: str
    output: str
    parallel: int
    n_predict: int
    resume: bool
    overwrite: bool
    retry_failed: bool
    compare: bool
    reuse: bool
    cache_ram: int  # MiB
    stats: str | None
    quiet: bool


@dataclass(frozen=True)
class ServeOptions(_Decoding):
    host: str
    port: int
    api_key: str | None
    parallel: int | None  # None: by --spec (cli.cmd_serve settles it)
    n_predict: int | None  # 0 or None: up to the end of the context
    max_queue: int
    cors: tuple[str, ...]
    max_connections: int
    read_timeout: float
    cache_ram: int | None  # MiB; None: promptcache.cache_bytes's default
    reuse: bool
    quiet: bool
    history: bool = True  # with an API key: that key's past replies as a drafting source (edgespec.history)


@dataclass(frozen=True)
class BenchOptions:
    methods: str
    suite: str | None
    categories: str | None
    n_predict: int
    repeat: int
    reuse: bool
    min_time: float
    limit: int
    out: str | None
    parallel: str | None  # "N,N,...": batch throughput instead
    llama_cpp_bin: str | None
    llama_cpp_kv: str | None
    models: ModelOptions
    drafting: DraftOptions


@dataclass(frozen=True)
class DoctorOptions:
    json: bool
    remeasure: bool
    models: ModelOptions
    drafting: DraftOptions = field(default_factory=DraftOptions)


@dataclass(frozen=True)
class PullOptions:
    name: str


@dataclass(frozen=True)
class ModelsOptions:
    dirs: tuple[str, ...]
    json: bool


@dataclass(frozen=True)
class KernelsOptions:
    build: bool
    json: bool


@dataclass(frozen=True)
class QuantizeOptions:
    src: str
    dst: str
    type: str


@dataclass(frozen=True)
class ConvertOptions:
    kind: str
    src: str
    model: str
    output: str


@dataclass(frozen=True)
class TrainOptions:
    kind: str
    model: str
    data: tuple[str, ...] | None
    tokens: int
    epochs: float
    max_new: int
    lr: float
    batch: int
    draft_vocab: int
    medusa_heads: int
    ttt_steps: int
    work: str | None
    exclude: str | None
    curve: str | None
    output: str | None
    n_ctx: int
    threads: int
    quiet: bool


def _take(cls, ns: argparse.Namespace, **given):
    """`cls` from the parsed attributes of the same names; `given` fills the others (groups, and
    what the command has no flag for). A field the parser does not define is a KeyError here."""
    return cls(**{f.name: given[f.name] if f.name in given else vars(ns)[f.name] for f in fields(cls)})


def _groups(ns: argparse.Namespace, sampling: bool = True, grammar: bool = True) -> dict:
    out = {"models": _take(ModelOptions, ns), "drafting": _take(DraftOptions, ns)}
    if sampling:
        out["sampling"] = _take(SamplingOptions, ns)
    if grammar:
        out["grammar"] = _take(GrammarOptions, ns)
    return out


def options(ns: argparse.Namespace):
    """The options of the command `ns.cmd` from its parsed arguments."""
    cmd = ns.cmd
    if cmd == "run":
        return _take(RunOptions, ns, **_groups(ns))
    if cmd == "chat":
        return _take(ChatOptions, ns, **_groups(ns))
    if cmd == "batch":
        return _take(BatchOptions, ns, **_groups(ns))
    if cmd == "serve":
        return _take(ServeOptions, ns, cors=tuple(ns.cors), **_groups(ns, grammar=False))
    if cmd == "bench":  # its draft group has no --lookahead-cache
        return _take(BenchOptions, ns, models=_take(ModelOptions, ns),
                     drafting=_take(DraftOptions, ns, lookahead_cache=None))
    if cmd == "doctor":
        return _take(DoctorOptions, ns, models=_take(ModelOptions, ns), drafting=DraftOptions())
    if cmd == "train":
        return _take(TrainOptions, ns, data=None if ns.data is None else tuple(ns.data))
    if cmd == "models":
        return _take(ModelsOptions, ns, dirs=tuple(ns.dirs))
    kinds = {"pull": PullOptions, "quantize": QuantizeOptions, "convert": ConvertOptions,
             "kernels": KernelsOptions}
    return _take(kinds[cmd], ns)
