"""`edgespec` command line: argument parsing, output formats, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import replace

from .. import __version__, methods
from ..errors import EdgespecError
from ..kvtypes import DEFAULT_KV, KV_TYPES, kv_spec, kv_types
from ..quants import QUANT_TYPES
from ..models import CHAT_MODEL
from .console import LogBars
from .options import (
    BatchOptions, BenchOptions, ChatOptions, ConvertOptions, DoctorOptions, DraftOptions, GrammarOptions, ModelOptions,
    KernelsOptions, ModelsOptions, PullOptions, QuantizeOptions, RunOptions, SamplingOptions, ServeOptions, TrainOptions,
    options,
)

EXIT_INTERRUPTED = 130


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None = "smollm2-135m-instruct") -> None:
    g = p.add_argument_group("models and hardware")
    g.add_argument("-m", "--model", default=default_model,
                   help="target model: catalog name, name:q4_0|q4_1|q8_0|f16, a .gguf path, org/repo[:quant] (Hugging "
                        "Face), ollama:NAME[:TAG] or lmstudio:PUBLISHER/MODEL[:QUANT] (docs/models.md) "
                        "(default: %(default)s)")
    g.add_argument("-md", "--model-draft", dest="draft", default=None,
                   help="draft model with the same vocabulary (default: the catalog's pair of -m, else the smallest "
                        "model on disk with its vocabulary and at most 40%% of its parameters; none: without one)")
    g.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=4096, help="context size in tokens (default: %(default)s)")
    g.add_argument("-t", "--threads", type=int, default=0, help="threads for the target (default: all cores, at most 8)")
    g.add_argument("-td", "--threads-draft", type=int, default=0, help="threads for the draft model (default: as -t)")
    g.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=0, help="target layers offloaded to the GPU (default: 0)")
    g.add_argument("-ngld", "--n-gpu-layers-draft", dest="ngld", type=int, default=0, help="draft layers offloaded to the GPU (default: 0)")
    g.add_argument("--kv-type", default=None, type=_kv_arg, metavar="T|K/V",
                   help="KV cache types: one for K and V, or K/V, from q8_0, f16, bf16 (default: q8_0/f16, the "
                        "fastest here, and batches stay bit-exact on a CPU because K and V types differ)")
    g.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", default=None, choices=list(KV_TYPES),
                   help="K cache type (as llama.cpp's -ctk; overrides --kv-type's K)")
    g.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", default=None, choices=list(KV_TYPES),
                   help="V cache type (as llama.cpp's -ctv; overrides --kv-type's V)")
    g.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="llama.cpp RPC servers (`rpc-server`) that lend their CPU or GPU to the target: -ngl N then "
                        "offloads its layers to them; the drafter stays on this machine")
    g.add_argument("--rpc-draft", default=None, metavar="HOST:PORT,...",
                   help="RPC servers for the draft model's offloaded layers (-ngld) (default: none, it stays here)")
    g.add_argument("--exactness", default="auto", choices=["auto", "strict", "batched"],
                   help="strict: verify only as many rows as the load probe found bit-identical to one-row decodes "
                        "(greedy output identical to plain); batched: verify in batches anyway, taking the backend's "
                        "batched numerics as the model's (the distribution exact, greedy equal except at near-ties); "
                        "auto: strict on a CPU, batched on a GPU whose batches are exact below 4 rows (default: auto)")
    g.add_argument("--exact-kernels", action="store_true",
                   help="K-quant models (Q4_K_M...) on a CPU under strict exactness: llama.cpp's per-row kernel at "
                        "every batch size (weights not repacked, tiled K-quant matmul off), so verification stays "
                        "bit-exact to 32 rows instead of 3; a plain step costs about 1.5x (docs/exactness.md)")


def _kv_arg(text: str) -> str:
    try:
        return kv_spec(*kv_types(text))
    except EdgespecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_setting(m: ModelOptions) -> str:
    """The K/V cache types from --kv-type, -ctk and -ctv (llama.kv_spec spelling)."""
    k, v = kv_types(m.kv_type or DEFAULT_KV)
    return kv_spec(m.cache_type_k or k, m.cache_type_v or v)


def _add_spec_args(p: argparse.ArgumentParser, default_spec: str = "auto") -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=default_spec, choices=methods.names(),
                   help="drafting method (default: %(default)s: lookahead, then the draft model when -md is given; "
                        "pearl: the draft model drafts in parallel with verification)")
    g.add_argument("--spec-draft-n-max", "--draft-max", dest="draft_n_max", type=int, default=16,
                   help="most tokens the draft model drafts per step (default: %(default)s)")
    g.add_argument("--spec-draft-n-min", "--draft-min", dest="draft_n_min", type=int, default=0,
                   help="draft at least N tokens (nodes) whenever the drafter has any, whatever the cost model says: "
                        "to measure acceptance where drafting does not pay (default: %(default)s)")
    g.add_argument("--spec-draft-p-min", dest="draft_p_min", type=float, default=0.0,
                   help="stop drafting when the draft model's top probability falls below this (default: %(default)s: "
                        "the cost model decides)")
    g.add_argument("--pearl-gamma", type=int, default=4, help="PEARL draft length per round (default: %(default)s)")
    g.add_argument("--lookahead-cache", default=None, metavar="PATH",
                   help="load the lookahead trie from PATH and save its output branches back after the run")
    _add_heads_arg(g)


def _add_heads_arg(g) -> None:
    g.add_argument("--heads", default=None, metavar="PATH",
                   help="heads for --spec medusa|eagle|eagle3|mtp: a .gguf made by `edgespec convert` or `edgespec "
                        "train`, or a checkpoint folder (converted into the cache on first use); default: the "
                        "heads cached or shipped for the target, if any")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 is off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling; 1 is off (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p times the top one; 0 is off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="random seed for a reproducible sampled run")


def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (exact under speculation: drafts are checked against the "
                             "constrained distribution)").add_mutually_exclusive_group()
    g.add_argument("--grammar-file", default=None, metavar="FILE",
                   help="constrain the output to a GBNF grammar (llama.cpp's format, root rule `root`)")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="constrain the output to JSON following this schema (a file, or the schema's JSON text)")


def _grammar(g: GrammarOptions | None) -> str | None:
    """The GBNF of --grammar-file or --json-schema, if any (one clear line when unreadable)."""
    from ..rows import json_schema_grammar

    if g is None:
        return None
    gf, js = g.grammar_file, g.json_schema
    if gf is not None:
        try:
            with open(gf, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise EdgespecError(f"cannot read grammar file {gf}: {getattr(e, 'strerror', None) or e}") from None
        if not text.strip():
            raise EdgespecError(f"grammar file {gf} is empty")
        return text
    if js is None:
        return None
    text = js
    if not js.lstrip().startswith("{"):
        try:
            with open(js, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise EdgespecError(f"--json-schema {js}: not a JSON object and not a readable file "
                                f"({getattr(e, 'strerror', None) or e})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise EdgespecError(f"--json-schema is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(schema, dict):
        raise EdgespecError("--json-schema must be a JSON object (a schema)")
    return json_schema_grammar(schema)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec", description="Local LLM inference, faster through lossless speculative decoding.")
    ap.add_argument("--version", action="version", version=f"edgespec {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="generate a reply to one prompt", description="Generate a reply to one prompt.")
    src = r.add_argument_group("prompt (one of; default: standard input)")
    src.add_argument("-p", "--prompt", default=None, help="prompt text")
    src.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    r.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=256, help="most tokens to generate (default: %(default)s)")
    r.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    r.add_argument("--system", default=None, help="system message for the chat template")
    r.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, stats} instead of streaming")
    _add_model_args(r)
    _add_spec_args(r)
    _add_sampling_args(r)
    _add_grammar_args(r)

    c = sub.add_parser("chat", help="chat in the terminal with live speculation stats (line by line when piped)",
                       description="Chat with a local model. In a terminal: a full-screen UI; when standard input "
                                   "or output is not a terminal: one prompt per input line, replies on stdout.")
    c.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=512, help="most tokens per reply (default: %(default)s)")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--no-reuse", dest="reuse", action="store_false",
                   help="read the whole conversation again every turn (default: the KV cache keeps it, and a turn "
                        "reads only what it adds)")
    c.add_argument("--no-history", dest="history", action="store_false",
                   help="do not draft from the replies you received before, nor keep this chat's (default: they are "
                        "kept in a bounded file in the model cache, shown by `edgespec doctor`, and drafted from)")
    _add_model_args(c, default_model=CHAT_MODEL)
    _add_spec_args(c)
    _add_sampling_args(c)
    _add_grammar_args(c)

    bt = sub.add_parser(
        "batch", help="run a JSONL file of requests (OpenAI batch format), several sequences at once",
        description="Run a JSONL file of requests through the local model. Input lines follow the OpenAI batch "
                    "format ({custom_id, method, url, body}) or are bare {\"prompt\"} / {\"messages\"} objects. "
                    "Every line gets one output line, written as soon as it is complete (in completion order); "
                    "a rerun on the same output skips what is done.")
    bt.add_argument("-i", "--input", required=True, help="input JSONL file, or - for standard input")
    bt.add_argument("-o", "--output", required=True, help="output JSONL file (appended; resumed when it exists), or - for standard output")
    bt.add_argument("-np", "--parallel", type=int, default=1,
                    help="sequences decoded together in each llama_decode (default: %(default)s); with more than one, "
                         "--spec is none, ngram, lookahead or auto, and -c is the context of each sequence")
    bt.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=256,
                    help="max_tokens for requests that do not set it (default: %(default)s)")
    res = bt.add_mutually_exclusive_group()
    res.add_argument("--resume", action="store_true", help="skip requests already in the output (the default)")
    res.add_argument("--overwrite", action="store_true", help="start the output file afresh instead of resuming")
    bt.add_argument("--retry-failed", action="store_true",
                    help="on resume, run again the requests whose lines say they failed in serving (status 5xx); "
                         "their old lines are removed (by default every line counts as done)")
    bt.add_argument("--compare", action="store_true",
                    help="then run the same requests with --spec none (not written) and report the speedup")
    bt.add_argument("--reuse", action="store_true",
                    help="each sequence slot keeps what it last held: a request goes to the slot whose KV cache shares "
                         "the longest prefix with its prompt and reads only the rest (a shared system prompt, a "
                         "conversation's next turn)")
    bt.add_argument("--cache-ram", type=int, default=0, metavar="MIB",
                    help="with --reuse: keep up to MIB MiB of slots' KV state in host RAM, so a request finds its "
                         "prefix after its slot was taken by another (default: %(default)s, off)")
    bt.add_argument("--stats", default=None, metavar="FILE", help="write the summary as JSON to FILE")
    bt.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_model_args(bt)
    _add_spec_args(bt)
    _add_sampling_args(bt)
    _add_grammar_args(bt)

    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (chat and completions, streaming, metrics)",
        description="Serve the model over HTTP with OpenAI's API: POST /v1/chat/completions and /v1/completions "
                    "(streamed with server-sent events or not), GET /v1/models, /health and /metrics (Prometheus). "
                    "Requests share the continuous-batching scheduler of `edgespec batch`: up to -np sequences per "
                    "decode, the rest queued.")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    sv.add_argument("--port", type=int, default=8080, help="port (default: %(default)s; 0: any free port)")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="require Authorization: Bearer KEY on every route but /health (default: the EDGESPEC_API_KEY "
                         "environment variable, else no key)")
    sv.add_argument("-np", "--parallel", type=int, default=None,
                    help="sequences decoded together (default: 4 when --spec decodes several sequences, else 1); "
                         "-c is the context of each")
    sv.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=0,
                    help="max_tokens for requests that do not set it (default: 0, up to the end of the context)")
    sv.add_argument("--max-queue", type=int, default=256,
                    help="requests that may wait for a slot; more get a 503 (default: %(default)s)")
    sv.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                    help="let web pages from ORIGIN (e.g. http://localhost:3000) call the API from a browser; "
                         "repeat for more (default: none)")
    sv.add_argument("--max-connections", type=int, default=64,
                    help="open connections at once; more get a 503 (default: %(default)s)")
    sv.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds a request's body may take to arrive, and an idle connection may stay "
                         "(default: %(default)s)")
    sv.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                    help="host RAM for a prompt cache of conversations' KV state, in MiB: a returning client whose "
                         "slot was taken reads only its new text (default: a quarter of the available memory, at "
                         "most 8 GiB; 0: off)")
    sv.add_argument("--no-reuse", dest="reuse", action="store_false",
                    help="read every request's prompt in full (no slot reuse, no RAM cache)")
    sv.add_argument("--no-history", dest="history", action="store_false",
                    help="with --api-key: do not draft from the replies that key received before, nor keep them "
                         "(default: kept in a bounded file of that key's own, never shared with another key)")
    sv.add_argument("-q", "--quiet", action="store_true", help="no progress while the model loads")
    _add_model_args(sv)
    _add_spec_args(sv)
    _add_sampling_args(sv)

    dr = sub.add_parser("doctor", help="what llama.cpp runs on here: backend, devices, offload, cost curve, exactness",
                        description="Report the backend in use (devices, GPU offload and RPC support, offloaded "
                                    "layers), the measured cost of verifying k tokens, the exactness probe and the "
                                    "policy in force, for a model and its flags.")
    dr.add_argument("--json", action="store_true", help="print one JSON object")
    dr.add_argument("--remeasure", action="store_true",
                    help="measure the cost of verifying k rows and the exactness probe again for this model and "
                         "setup, replacing the cached ones (once the machine's load or hardware has changed)")
    _add_model_args(dr)

    kr = sub.add_parser("kernels", help="which llama.cpp CPU kernels run: edgespec's batch-invariant build or the stock ones",
                        description="Say which llama.cpp CPU kernels this install loads (edgespec's batch-invariant "
                                    "build of ggml-cpu, made at install time, or llama-cpp-python's own) and why; "
                                    "--build makes the build again into the cache (about a minute).")
    kr.add_argument("--build", action="store_true", help="build the patched ggml-cpu now (into the cache folder)")
    kr.add_argument("--json", action="store_true", help="print one JSON object")

    pl = sub.add_parser("pull", help="fetch a catalog model (or variant), or a Hugging Face GGUF, into its cache")
    pl.add_argument("name", help="catalog name, optionally name:q4_0|q4_1|q8_0|f16, or org/repo[:quant]")

    mo = sub.add_parser("models", help="list the catalog and every GGUF on disk: caches, Ollama, LM Studio, folders",
                        description="List the catalog, and every GGUF found in edgespec's cache, the Hugging Face "
                                    "cache, llama.cpp's, Ollama's and LM Studio's stores and the --dir folders, with "
                                    "what its header says and which can draft for which (docs/models.md).")
    mo.add_argument("--dir", dest="dirs", action="append", default=[], metavar="FOLDER",
                    help="also list the GGUF files in FOLDER and its subfolders (repeatable)")
    mo.add_argument("--json", action="store_true", help="print one JSON object")

    q = sub.add_parser("quantize", help="requantize a GGUF with llama.cpp's quantize API")
    q.add_argument("src", help="source model (path or catalog name)")
    q.add_argument("dst", help="output .gguf path")
    q.add_argument("type", choices=list(QUANT_TYPES), help="target type")

    b = sub.add_parser("bench", help="measure methods side by side on a prompt suite")
    b.add_argument("--methods", default="none,ngram,lookahead", help="comma-separated methods; `none` is always run (default: %(default)s)")
    b.add_argument("--suite", default=None, metavar="FILE|mtbench|humaneval",
                   help="prompt file (JSONL: id, category, messages or prompt, max_tokens), or MT-bench first turns, "
                        "or HumanEval (read from their PyPI wheels); default: the built-in suite")
    b.add_argument("--categories", default=None, help="comma-separated categories (or prefixes) to keep")
    b.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=256, help="tokens per prompt (default: %(default)s)")
    b.add_argument("--repeat", type=int, default=1, help="runs per prompt and method (default: %(default)s)")
    b.add_argument("--reuse", action="store_true",
                   help="read each prompt once: every method then starts from the cached prompt and reads only its "
                        "last token (generation rates are the same; a long prompt's reading is not repeated per method)")
    b.add_argument("--min-time", dest="min_time", type=float, default=1.0, metavar="SECONDS",
                   help="within a repeat, run every method again, interleaved, until plain decoding has generated "
                        "for this long; a short answer's times and counts are then the sums over those rounds "
                        "(default: %(default)s; 0: one round)")
    b.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    b.add_argument("--out", default=None, help="folder for report.json")
    b.add_argument("--parallel", default=None, metavar="N,N,...",
                   help="measure batch throughput instead: the suite as one batch (as `edgespec batch`) with each "
                        "number of sequences per decode, e.g. 1,4")
    b.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="also run llama.cpp's llama-completion and llama-lookup from DIR on the same prompts")
    b.add_argument("--llama-cpp-kv", default=None, metavar="default|T|K/V",
                   type=lambda t: t if t == "default" else _kv_arg(t),
                   help="KV cache types for llama.cpp's tools: default (theirs, f16, as a user runs them) or types "
                        "(default: the same as ours)")
    _add_model_args(b)
    g = b.add_argument_group("draft model")
    g.add_argument("--spec-draft-n-max", "--draft-max", dest="draft_n_max", type=int, default=16)
    g.add_argument("--spec-draft-n-min", "--draft-min", dest="draft_n_min", type=int, default=0)
    g.add_argument("--spec-draft-p-min", dest="draft_p_min", type=float, default=0.0)
    g.add_argument("--pearl-gamma", type=int, default=4)
    _add_heads_arg(g)

    cv = sub.add_parser("convert", help="turn a published Medusa/EAGLE/EAGLE-3/MTP checkpoint into a heads GGUF",
                        description="Convert a checkpoint folder in its upstream layout (FasterDecoding/Medusa, "
                                    "SafeAILab/EAGLE, EAGLE-3) into a GGUF file for --heads. EAGLE-3 is written as "
                                    "llama.cpp's own eagle3 file (it also runs in llama-speculative-simple).")
    cv.add_argument("kind", choices=["medusa", "eagle", "eagle3", "mtp"], help="checkpoint kind")
    cv.add_argument("src", help="checkpoint folder (config.json and .safetensors/.bin/.pt weights)")
    cv.add_argument("--target", "-m", dest="model", default="smollm2-135m-instruct",
                    help="the target model the heads were trained for (default: %(default)s)")
    cv.add_argument("-o", "--output", required=True, help="output .gguf path")

    tr = sub.add_parser("train", help="train Medusa/EAGLE/EAGLE-3/MTP heads for a target on this machine (the train extra)",
                        description="Self-distillation: the target answers prompts, its hidden states are stored "
                                    "(resumable), heads are trained with JAX and written in the upstream checkpoint "
                                    "layout and as a heads GGUF. Ctrl+C stops and a rerun resumes.")
    tr.add_argument("kind", choices=["medusa", "eagle", "eagle3", "mtp"], help="what to train")
    tr.add_argument("-m", "--model", default="smollm2-135m-instruct",
                    help="target model: catalog name, name:quant, or a .gguf path (default: %(default)s)")
    tr.add_argument("--data", action="append", default=None, metavar="SUITE|FILE",
                    help="prompts: builtin, mtbench, humaneval, a JSONL file (messages or prompt per line) or a text "
                         "file (prompts separated by blank lines); repeatable (default: mtbench, humaneval, builtin)")
    tr.add_argument("--tokens", type=int, default=40000, help="tokens of training data to collect (default: %(default)s)")
    tr.add_argument("--epochs", type=float, default=4.0, help="passes over the data (default: %(default)s)")
    tr.add_argument("--max-new", type=int, default=256, help="tokens the target answers per prompt (default: %(default)s)")
    tr.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    tr.add_argument("--batch", type=int, default=256, help="positions per step (default: %(default)s)")
    tr.add_argument("--draft-vocab", type=int, default=8192,
                    help="draft vocabulary: the N tokens the target says most often (default: %(default)s)")
    tr.add_argument("--heads-n", dest="medusa_heads", type=int, default=3, help="Medusa heads (default: %(default)s)")
    tr.add_argument("--ttt-steps", type=int, default=4,
                    help="EAGLE-3: draft steps unrolled in training (training-time test; default: %(default)s)")
    tr.add_argument("--work", default=None, metavar="DIR",
                    help="folder for data, checkpoints, report and curves (default: in the cache, per target)")
    tr.add_argument("--exclude", default=None, metavar="FILE",
                    help="leave out prompts that are also in this JSONL file (your evaluation prompts)")
    tr.add_argument("--curve", default=None, metavar="F,F,...",
                    help="a learning curve instead of heads: train from scratch on these fractions of the "
                         "training documents (e.g. 0.25,0.5,1) and report the held-out agreement of each")
    tr.add_argument("-o", "--output", default=None,
                    help="output .gguf (default: the heads cache, where --spec finds it for this target)")
    tr.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=2048, help="context for data collection (default: %(default)s)")
    tr.add_argument("-t", "--threads", type=int, default=0, help="threads (default: all cores, at most 8)")
    tr.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return ap


def method_names(text: str) -> list[str]:
    """bench's --methods list: the named methods, else auto (what the engine is loaded for)."""
    return [m.strip() for m in text.split(",") if m.strip()] if text else ["auto"]


def _draft_spec(m: ModelOptions, names: list[str]) -> str | None:
    """The draft model for the methods `names` (`_draft_choice`)."""
    return _draft_choice(m, names)[0]


def _draft_choice(m: ModelOptions, names: list[str]) -> tuple[str | None, str]:
    """-md, else the paired draft for -m (`models.paired_draft`: the catalog's pair,
    qwen2.5-coder-1.5b-instruct's 0.5B sibling, else the smallest model on disk with its
    vocabulary) for the methods `names`, and why it was chosen. The catalog's pair is fetched on
    first use where a method needs a draft model (draft, pearl); `auto` takes one only when it is
    already on disk (never a download for it) and then switches it off by measurement wherever it
    does not pay (drafters.chain). `-md none`: none."""
    if m.draft is not None:
        return (None, "") if m.draft == "none" else (m.draft, "-md")
    need = any(n in methods.METHODS and methods.METHODS[n].needs_draft_model for n in names)
    if not need and "auto" not in names:
        return None, ""
    from ..models import CATALOG, is_cached, paired_draft

    pair = paired_draft(m.model)
    if pair is None or not (need or is_cached(pair)):
        return None, ""
    catalog = CATALOG.get(m.model)  # a variant (name:quant) has no catalog pair
    return pair, "catalog pair" if catalog is not None and catalog.draft == pair else "same vocabulary"


def _engine_config(m: ModelOptions, d: DraftOptions, spec: str = "auto", names: list[str] | None = None):
    """The engine for method `spec` (bench and doctor: auto), its draft model chosen for the
    methods `names` (default: `spec`)."""
    from ..engine import EngineConfig

    draft, why = _draft_choice(m, [spec] if names is None else names)
    return EngineConfig(
        model=m.model, draft=draft, draft_why=why, n_ctx=m.n_ctx, threads=m.threads,
        threads_draft=m.threads_draft, n_gpu_layers=m.ngl, n_gpu_layers_draft=m.ngld, draft_n_max=d.draft_n_max,
        draft_n_min=d.draft_n_min, draft_p_min=d.draft_p_min, lookahead_cache=d.lookahead_cache,
        kv_type=kv_setting(m), exactness=m.exactness, exact_kernels=m.exact_kernels, rpc=_endpoints(m.rpc),
        rpc_draft=_endpoints(m.rpc_draft),
        # chains need one sequence; only trees borrow more (and a multi-sequence cache costs a little)
        max_branches=8 if methods.get(spec).trees else 1,
        pearl_gamma=d.pearl_gamma, heads=d.heads,
    )


def _endpoints(text: str | None) -> tuple[str, ...]:
    from ..backend import parse_endpoint

    if not text:
        return ()
    eps = tuple(x.strip() for x in text.split(",") if x.strip())
    for ep in eps:
        parse_endpoint(ep)  # one clear line before anything loads
    return eps


def _read_prompt(a: RunOptions) -> str:
    if a.prompt is not None and a.file is not None:
        raise EdgespecError("give the prompt with -p or -f, not both")
    if a.prompt is not None:
        return a.prompt
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as e:
            raise EdgespecError(f"prompt file {a.file} is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise EdgespecError(f"cannot read prompt file {a.file}: {e.strerror}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise EdgespecError("no prompt: pass -p TEXT, -f FILE, or pipe it on standard input")
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as e:
        raise EdgespecError(f"standard input is not UTF-8 text (byte {e.start})") from None


def _sampling(s: SamplingOptions, g: GrammarOptions | None):
    """The sampling flags, checked as a batch line's body fields are (one validation for both)."""
    from ..sampling import make_sampling

    return make_sampling(s.temp, s.top_k, s.top_p, s.min_p, s.seed, grammar=_grammar(g))


def _validate(m: ModelOptions, d: DraftOptions, n_predict: int | None = 1, spec: str | None = None,
              sampling: SamplingOptions | None = None, grammar: GrammarOptions | None = None):
    """Check the shared flags, in this order, with one line for the first that is wrong; the
    sampling settings (with the grammar read) when the command has sampling flags, else None."""
    if n_predict is not None and n_predict < 1:
        raise EdgespecError("-n must be at least 1")
    if m.n_ctx < 16:
        raise EdgespecError("-c must be at least 16")
    if m.threads < 0 or m.threads_draft < 0:
        raise EdgespecError("-t and -td must be at least 1 (0: all cores, at most 8)")
    if m.ngl < -1 or m.ngld < -1:
        raise EdgespecError("-ngl and -ngld must be at least 0 (-1: all layers)")
    cfg = _sampling(sampling, grammar) if sampling is not None else None
    if d.draft_n_max < 0 or d.draft_n_min < 0 or d.draft_n_min > d.draft_n_max:
        raise EdgespecError("draft lengths need 0 <= --spec-draft-n-min <= --spec-draft-n-max")
    if spec is not None and methods.get(spec).needs_draft_model and not _draft_spec(m, [spec]):
        from ..models.local import DRAFT_SHARE

        raise EdgespecError(f"--spec {spec} needs a draft model: pass -md MODEL (no model on disk shares the "
                            f"vocabulary of {m.model} with at most {DRAFT_SHARE:.0%} of its parameters; "
                            "`edgespec models` lists them)")
    if d.pearl_gamma < 1:
        raise EdgespecError("--pearl-gamma must be at least 1")
    return cfg


def cmd_run(a: RunOptions) -> int:
    from ..engine import Engine
    from ..text import TextStream

    sampling = _validate(a.models, a.drafting, a.n_predict, a.spec, a.sampling, a.grammar)
    text = _read_prompt(a)
    if not text.strip():
        raise EdgespecError("empty prompt")
    engine = Engine(_engine_config(a.models, a.drafting, a.spec), quiet=a.json)
    if a.raw:
        prompt = engine.prompt_tokens(text, raw=True, special=True)  # the user's own prompt, as written
    else:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": text}]
        prompt = engine.prompt_tokens(messages=msgs)
    gen = engine.start(prompt, a.n_predict, sampling, a.spec)
    used = gen.drafter_name
    stream = TextStream(engine.target)
    interrupted = False
    try:
        for ev in gen:
            if not a.json:
                sys.stdout.write(stream.feed(ev.tokens))
                sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    st = gen.stats
    if a.json:
        out = {
            "text": engine.target.detokenize(gen.tokens),
            "token_ids": gen.tokens,
            "stats": {"method": a.spec, "drafter": used, "draft_model": engine.cfg.draft if engine.draft_model else None,
                      "draft_model_why": engine.cfg.draft_why or None, **st.to_dict(), "cost_ms": engine.cost.to_dict(),
                      "exactness": engine.exactness_info()},
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        # a draft model edgespec chose (not -md) is named: it may be any file found in a store
        picked = (f"; draft model {engine.cfg.draft} ({engine.cfg.draft_why})"
                  if engine.draft_model and engine.cfg.draft_why in ("same vocabulary", "catalog pair") else "")
        print(f"[{a.spec}{' (' + used + ')' if used != a.spec else ''}] {st.summary()}{picked}"
              f"{' - stopped' if interrupted else ''}", file=sys.stderr)
    engine.close()  # writes back what the cost curve's online correction learned, for the next run
    return EXIT_INTERRUPTED if interrupted else 0


def cmd_chat(a: ChatOptions) -> int:
    from ..engine import Engine
    from .session import ChatSession

    sampling = _validate(a.models, a.drafting, a.n_predict, a.spec, a.sampling, a.grammar)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    cfg = _engine_config(a.models, a.drafting, a.spec)
    if interactive:  # the drafter can be switched live: allow trees
        cfg = replace(cfg, max_branches=8)
    if a.history:  # the replies this user received, kept across conversations (edgespec.history)
        from .. import history
        from ..models import cache_root

        cfg = replace(cfg, history=str(history.path_for(cache_root())))
    engine = Engine(cfg, quiet=not interactive)
    session = ChatSession(engine, a.spec, sampling, a.n_predict, a.system, reuse=a.reuse)
    if interactive:
        try:
            from edgespec.tui.app import run_app
        except ImportError:
            raise EdgespecError("the chat UI needs Textual: pip install textual") from None
        return run_app(session)
    return _chat_lines(session)


def _chat_lines(session) -> int:
    """Pipes and scripts: one prompt per line; the reply and a stats line for each."""
    for line in sys.stdin:
        text = line.strip()
        if not text:
            continue
        try:
            reply = session.send(text, lambda ev, piece: (sys.stdout.write(piece), sys.stdout.flush()))
        except KeyboardInterrupt:
            print("", file=sys.stdout)
            return EXIT_INTERRUPTED
        print("", flush=True)
        print(f"[{session.method}] {reply.stats.summary()}", file=sys.stderr)
    return 0


def cmd_doctor(a: DoctorOptions) -> int:
    from .doctor import run_doctor

    _validate(a.models, a.drafting)
    return run_doctor(a, _engine_config(a.models, a.drafting))


def cmd_pull(a: PullOptions) -> int:
    from ..models import resolve

    print(resolve(a.name))
    return 0


def cmd_models(a: ModelsOptions) -> int:
    from ..heads.store import heads_dir, list_heads
    from ..models import list_models, models_dir
    from ..models.local import DRAFT_SHARE, list_local

    rows, found, heads = list_models(), list_local(a.dirs), list_heads()
    if a.json:
        print(json.dumps({"cache": str(models_dir()), "catalog": rows, "models": found,
                          "heads": [{**h, "path": str(h["path"])} for h in heads]}))
        return 0
    print(f"cache: {models_dir()}  (set EDGESPEC_CACHE to move it)")
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        size = f"{r['size'] / 1e6:7.1f} MB" if r["size"] else "        ?"
        state = "cached" if r["cached"] else "  -   "
        print(f"{r['name']:<{w}}  {state}  {size}  {r['description']}")
    print("\non disk (edgespec's cache, Hugging Face cache, llama.cpp, Ollama, LM Studio, --dir):")
    good = [r for r in found if "note" not in r]
    if not found:
        print("  nothing found")
    w = max((len(r["name"]) for r in good), default=4)
    if good:
        print(f"  {'name':<{w}}  {'store':<9} {'arch':<10} {'params':>7}  {'quant':<8} {'size':>10}  "
              f"{'context':>7}  vocabulary")
    for r in good:
        print(f"  {r['name']:<{w}}  {r['store']:<9} {r['arch']:<10} {_count(r['params']):>7}  {r['quant']:<8} "
              f"{r['size'] / 1e6:7.1f} MB  {r['context_length'] or '?':>7}  {r['n_vocab']} {r['vocab']}")
    for r in found:  # one line each, whatever a file's name holds
        if "note" in r:
            print(f"  note: {r['name']}: {r['note']}".replace("\n", "\\n").replace("\r", "\\r"))
    pairs = [r for r in good if r["drafts"]]
    if pairs:
        print(f"\ndrafts (same vocabulary, at most {DRAFT_SHARE:.0%} of the parameters; auto takes the first):")
        for r in pairs:
            print(f"  {r['name']}  <-  {', '.join(r['drafts'])}")
    print(f"\nheads: {heads_dir()} (and shipped with edgespec)")
    if not heads:
        print("  none (make them with `edgespec train` or `edgespec convert`)")
    for h in heads:
        where = "shipped" if h["shipped"] else "cached "
        print(f"  {h['kind']:<7} {where} {h['size'] / 1e6:6.1f} MB  for {h['target']}  {h['path'].name}")
    return 0


def _count(n: int) -> str:
    """A parameter count: 135M, 1.78B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def cmd_quantize(a: QuantizeOptions) -> int:
    from pathlib import Path

    from ..llama import quantize
    from ..models import resolve

    src = resolve(a.src)
    dst = Path(a.dst)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        quantize(src, tmp, a.type)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    print(dst)
    return 0


def cmd_batch(a: BatchOptions) -> int:
    from .batch import run_batch

    sampling = _validate(a.models, a.drafting, a.n_predict, a.spec, a.sampling, a.grammar)
    if a.parallel < 1:
        raise EdgespecError("-np must be at least 1")
    if a.parallel > 64:
        raise EdgespecError("-np must be at most 64")
    if a.parallel > 1 and not methods.get(a.spec).multi_sequence:
        raise EdgespecError(f"--spec {a.spec} decodes one sequence at a time: use -np 1, or --spec lookahead")
    if not 0 <= a.cache_ram <= 1 << 30:
        raise EdgespecError("--cache-ram takes MiB from 0 to 2**30")
    if a.cache_ram and not a.reuse:
        raise EdgespecError("--cache-ram keeps KV state for --reuse: add --reuse")
    cfg = _engine_config(a.models, a.drafting, a.spec)
    if hasattr(signal, "SIGTERM"):  # `kill`: stop like Ctrl+C, keeping every finished result
        signal.signal(signal.SIGTERM, _raise_interrupt)
    return run_batch(a, cfg, sampling)


def cmd_serve(a: ServeOptions) -> int:
    from .server.command import run_serve

    if a.n_predict == 0:
        a = replace(a, n_predict=None)  # up to the context: filled in once the engine knows it
    sampling = _validate(a.models, a.drafting, a.n_predict, a.spec, a.sampling)
    m = methods.get(a.spec)
    if a.parallel is None:
        a = replace(a, parallel=4 if m.multi_sequence else 1)
    if not 1 <= a.parallel <= 64:
        raise EdgespecError("-np must be between 1 and 64")
    if a.parallel > 1 and not m.multi_sequence:
        raise EdgespecError(f"--spec {a.spec} decodes one sequence at a time: use -np 1, or one of "
                            f"{', '.join(methods.multi_sequence())}")
    if not 0 <= a.port <= 65535:
        raise EdgespecError("--port must be between 0 and 65535")
    if a.max_queue < 0:
        raise EdgespecError("--max-queue must be at least 0")
    if a.api_key is not None and not a.api_key.strip():
        raise EdgespecError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if a.max_connections < 1:
        raise EdgespecError("--max-connections must be at least 1")
    if not a.read_timeout > 0:
        raise EdgespecError("--read-timeout must be above 0 seconds")
    if a.cache_ram is not None and not 0 <= a.cache_ram <= 1 << 30:
        raise EdgespecError("--cache-ram takes MiB from 0 to 2**30 (0: off)")
    return run_serve(a, _engine_config(a.models, a.drafting, a.spec), sampling)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_bench(a: BenchOptions) -> int:
    from .bench import run_bench

    _validate(a.models, a.drafting, a.n_predict)
    if a.repeat < 1:
        raise EdgespecError("--repeat must be at least 1")
    if not 0 <= a.min_time <= 600:
        raise EdgespecError("--min-time takes seconds from 0 to 600")
    if a.limit < 0:
        raise EdgespecError("--limit must be at least 0 (0: every prompt)")
    if a.out and os.path.exists(a.out) and not os.path.isdir(a.out):
        raise EdgespecError(f"--out {a.out} is a file; give a folder for report.json")
    return run_bench(a, _engine_config(a.models, a.drafting, "auto", method_names(a.methods)))


def cmd_kernels(a: KernelsOptions) -> int:
    from .kernels_cmd import run_kernels

    return run_kernels(a)


def cmd_convert(a: ConvertOptions) -> int:
    from .heads_cmd import run_convert

    return run_convert(a)


def cmd_train(a: TrainOptions) -> int:
    from .heads_cmd import run_train

    return run_train(a)


class _StderrHandler(logging.Handler):
    """The core's notes (logging), one line each on whatever stderr is at the time; measured
    progress as a bar (console.LogBars)."""

    def __init__(self):
        super().__init__()
        self.bars = LogBars()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "progress", False) and not sys.stderr.isatty():
            return  # a note of progress, for a person watching a terminal
        try:
            if LogBars.is_bar(record):
                self.bars.show(record)
            else:
                self.bars.write(f"edgespec: {record.getMessage()}")
        except Exception:
            self.handleError(record)


def setup_logging() -> logging.Logger:
    lg = logging.getLogger("edgespec")
    if not any(isinstance(h, _StderrHandler) for h in lg.handlers):
        lg.addHandler(_StderrHandler())
    lg.setLevel(logging.INFO)
    lg.propagate = False
    return lg


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd is None:
        ap.print_help()
        return 2
    handlers = {"run": cmd_run, "chat": cmd_chat, "pull": cmd_pull, "models": cmd_models, "quantize": cmd_quantize, "bench": cmd_bench,
                "batch": cmd_batch, "serve": cmd_serve, "doctor": cmd_doctor, "convert": cmd_convert, "train": cmd_train,
                "kernels": cmd_kernels}
    if a.cmd in ("run", "chat", "serve", "batch"):
        from .. import kernels

        notice = kernels.build_notice()
        if notice:
            print(notice, file=sys.stderr)
    try:
        return handlers[a.cmd](options(a))
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL) if hasattr(signal, "SIGPIPE") else None
    sys.exit(main())
