"""Tool calling and what real clients send: `tools` / `tool_choice` through the model's template
or the generic tool prompt, calls parsed back into `tool_calls`, `tool` messages in the history,
streamed tool-call deltas; the official `openai` client and LangChain's `ChatOpenAI` against a real
`edgespec serve` on SmolLM2 (one server for the module, few tokens)."""

import json
import threading
import time

import openai
import pytest
import uvicorn

from edgespec import chat
from edgespec.engine import Engine, EngineConfig
from edgespec.serving.requests import Defaults, Request, fill_from_body
from edgespec.serving.loop import run_requests
from edgespec.serving.schema import CHAT_URL, TEXT_URL, RequestError, parse_body
from edgespec.frontends.server.app import Server
from edgespec.frontends.server.command import bind
from edgespec.frontends.server.worker import Worker
from edgespec.rows import Grammar
from edgespec.sampling import SamplingConfig
from edgespec.tools import CallHold, call_grammar, for_template, generic_prompt, parse_calls, template_takes_tools

MODEL = "smollm2-135m-instruct:q4_0"
KEY = "tools-key"
N = 48

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# A small template in the Hugging Face convention that takes tools (as Qwen2.5's does).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


# -- without a model --------------------------------------------------------------------------


def test_calls_are_parsed_and_other_text_stays_content():
    text = ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>not json</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    rest, calls = parse_calls(text, {"add", "get_weather"})
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert rest.startswith("Sure. ") and "nope" in rest and "not json" in rest and "add" not in rest
    assert parse_calls("no calls here", {"add"}) == ("no calls here", [])


def test_call_hold_streams_content_until_a_call_starts():
    h = CallHold()
    got = [h.feed(p) for p in ["Hel", "lo <", "tool", "_ca", "ll>{", "}"]]
    assert got == ["Hel", "lo ", "", "", "", ""] and h.sent == "Hello " and h.inside
    h = CallHold()
    assert [h.feed(p) for p in ["a <to", "p> b"]] == ["a ", "<top> b"]  # not a call after all


def test_fenced_and_bare_json_calls_as_qwen_coder_answers():
    """Qwen2.5-Coder answers a tool call as a ```json block (or bare JSON) even when its template
    asks for <tool_call>; a block of another language, or naming no offered function, is text."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    names = {"get_weather"}
    for text, rest in ((f"```json\n{call}\n```", ""), (call, ""), (f"```\n[{call}]\n```", ""),
                       (f"```python\nx = 1\n```\nThen:\n```json\n{call}\n```", "```python\nx = 1\n```\nThen:\n")):
        got_rest, calls = parse_calls(text, names)
        assert got_rest == rest and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}], text
        h = CallHold(names)
        streamed = "".join(h.feed(text[i:i + 2]) for i in range(0, len(text), 2))
        assert streamed == rest and h.inside, text
    for text in ("```python\nprint(1)\n```", '```json\n{"name": "other", "arguments": {}}\n``` after', '{"a": 1}'):
        assert parse_calls(text, names) == (text, [])
    h = CallHold(names)  # a code block that is no call goes out once it closes
    assert "".join(h.feed(p) for p in ["See:\n``", "`py\nx", " = 1\n``", "`\nok"]) == "See:\n```py\nx = 1\n```\nok"


def test_generic_prompt_and_history_for_a_template_without_tools():
    msgs, tools = for_template("{{ messages }}", [{"role": "system", "content": "Be brief."}] + HISTORY, TOOLS)
    assert tools is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n")
    assert msgs[0]["content"].endswith(generic_prompt(TOOLS)) and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                         '{"city": "Paris"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nSunny, 21 C\n</tool_response>"}
    msgs, _ = for_template(None, ASK, TOOLS)  # no system message: one is added
    assert msgs[0]["role"] == "system" and msgs[1] == ASK[0]
    msgs, _ = for_template(None, HISTORY, None)  # tool_choice none: history as text, no tools offered
    assert "<tools>" not in json.dumps(msgs) and msgs[-1]["role"] == "user"


def test_a_template_that_takes_tools_renders_them_itself():
    assert template_takes_tools(TOOLS_TEMPLATE) and not template_takes_tools("{{ messages }}")
    msgs, tools = for_template(TOOLS_TEMPLATE, HISTORY, TOOLS)
    assert tools == TOOLS and msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"}
    parts = chat.render_parts(TOOLS_TEMPLATE, msgs, tools=tools, has_marker=lambda s: "<|" in s)
    text = "".join(t for t, _ in parts)
    assert text.startswith("<|im_start|>system\nTools:{") and "get_weather" in text
    # keys in the order written, as Hugging Face's tojson renders them (Jinja's own sorts them)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\nSunny, 21 C<|im_end|>" in text
    assert ("Sunny, 21 C", False) in parts  # a tool result is content (text), the rest the template's


def _err(body, url=CHAT_URL) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_body(url, body)
    return e.value


@pytest.mark.parametrize("extra,needle", [
    ({"tools": [WEATHER] * 2}, "used twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]}, "at most 64 tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 20000}}]}, "bytes of JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"a":' * 20 + "1" + "}" * 20)}}]}, "nests deeper"),
    ({"tools": [{"type": "function"}]}, "tools must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not one of the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]: a message with role tool needs tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "needs content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only an assistant"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]},
     "tool_calls must be"),
])
def test_tool_fields_are_bounded_with_a_clear_400(extra, needle):
    e = _err({"messages": ASK, **extra})
    assert e.status == 400 and needle in str(e), str(e)


def test_tools_are_for_chat_and_the_accepted_forms():
    assert "chat" in str(_err({"prompt": "p", "tools": TOOLS}, TEXT_URL))
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "add"}}):
        b = parse_body(CHAT_URL, {"messages": HISTORY, "tools": TOOLS, "tool_choice": choice,
                                  "parallel_tool_calls": True})
        assert (b.offered_tools is None) == (choice == "none")
    req = Request(1, "x")
    fill_from_body(req, CHAT_URL, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}, Defaults())
    assert req.tools is None and req.tool_names is None and req.sampling.grammar is None
    fill_from_body(req, CHAT_URL, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}, Defaults())
    assert req.tool_names == {"add", "get_weather"} and req.sampling.grammar.startswith("root ::= \"<tool_call>")


# -- on the model ---------------------------------------------------------------------------


def test_call_grammars_parse_in_llama_cpp(smol):
    for g in (call_grammar(TOOLS), call_grammar(TOOLS, "add"), call_grammar(TOOLS, parallel=True),
              call_grammar([{"type": "function", "function": {"name": "noargs"}}])):
        Grammar(smol.target, g).close()


def _ask(engine, body: dict, method: str) -> dict:
    req = Request(0, "x")
    fill_from_body(req, CHAT_URL, body, Defaults(N, SamplingConfig()))
    out = []
    run_requests(engine, [req], method, 1, lambda r, rec: out.append(rec))
    return out[0]["response"]["body"]


class _Srv:
    def __init__(self):
        self.engine = Engine(EngineConfig(model=MODEL, n_ctx=1024, threads=2, max_branches=8))
        # what plain decoding (--spec none) answers, before the server's worker owns the engine
        forced = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
        self.ref_call = _ask(self.engine, forced, "none")["choices"][0]["message"]["tool_calls"][0]["function"]
        self.ref_lp = _ask(self.engine, {"messages": ASK, "logprobs": True, "max_tokens": 8}, "none")
        self.worker = Worker(self.engine, "lookahead", 1, max_queue=16)
        self.server = Server(self.engine, self.worker, MODEL, Defaults(N, SamplingConfig()), KEY)
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.worker.start()
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, log_level="warning", lifespan="off",
                                                timeout_graceful_shutdown=2))
        self.uv.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(100):
            if self.uv.started:
                break
            time.sleep(0.05)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(30)
        self.worker.close()
        self.sock.close()
        self.engine.close()


@pytest.fixture(scope="module")
def srv():
    s = _Srv()
    yield s
    s.close()


def test_openai_client_required_and_named_tool_calls(srv):
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=N)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    # greedy and speculative (lookahead): the call plain constrained decoding makes
    assert (call.function.name, call.function.arguments) == (srv.ref_call["name"], srv.ref_call["arguments"])
    assert call.function.name in ("get_weather", "add")
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=N)
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_openai_client_history_with_tool_calls_and_results(srv):
    r = srv.client().chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=24)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_reassemble_to_the_call(srv):
    chunks = list(srv.client().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                       max_tokens=N, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                c["id"] = d.id
                assert d.type == "function"
            if d.function and d.function.name:
                c["name"] += d.function.name
            if d.function and d.function.arguments:
                c["arguments"] += d.function.arguments
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (srv.ref_call["name"], srv.ref_call["arguments"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks)


def _langchain(srv, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120, temperature=0,
                      **kw)


def test_langchain_structured_output_json_schema(srv):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    llm = _langchain(srv, max_tokens=40).with_structured_output(City, method="json_schema")
    got = llm.invoke("Name a large city in France and its country.")
    assert isinstance(got, City) and got.name and got.country


def test_langchain_bind_tools_round_trip(srv):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Sunny, 21 C in {city}"

    for choice in ("get_weather", "required"):
        llm = _langchain(srv, max_tokens=N).bind_tools([get_weather], tool_choice=choice)
        msgs = [HumanMessage("What is the weather in Paris?")]
        ai = llm.invoke(msgs)
        assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
        assert isinstance(ai.tool_calls[0]["args"]["city"], str)
        result = get_weather.invoke(ai.tool_calls[0]["args"])
        msgs += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
        final = _langchain(srv, max_tokens=24).bind_tools([get_weather]).invoke(msgs)
        assert isinstance(final.content, str) and final.content


def test_langchain_logprobs_equal_plain(srv):
    ai = _langchain(srv, max_tokens=8, logprobs=True).invoke(ASK[0]["content"])
    got = [(e["token"], e["logprob"]) for e in ai.response_metadata["logprobs"]["content"]]
    want = [(e["token"], e["logprob"]) for e in srv.ref_lp["choices"][0]["logprobs"]["content"]]
    assert got == want and len(got) == 8


def test_completions_echo_and_suffix(srv):
    c = srv.client()
    p = "The capital of France is"
    plain = c.completions.create(model=MODEL, prompt=p, max_tokens=6, logprobs=1)
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=6, echo=True, logprobs=1)
    assert r.choices[0].text == p + plain.choices[0].text
    lp = r.choices[0].logprobs
    n_prompt = len(lp.tokens) - len(plain.choices[0].logprobs.tokens)
    assert n_prompt > 0 and lp.token_logprobs[:n_prompt] == [None] * n_prompt
    assert lp.token_logprobs[n_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert "".join(lp.tokens[:n_prompt]) == p and lp.text_offset[n_prompt] == len(p)
    text = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=6, echo=True,
                                                                     stream=True))
    assert text == r.choices[0].text
    # SmolLM2's vocabulary has no fill-in-the-middle tokens: suffix is a clear 400
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="def add(a, b):\n", suffix="\n\nprint(add(1, 2))", max_tokens=6)
    assert "fill-in-the-middle" in str(e.value) and e.value.body["code"] == "unsupported"
