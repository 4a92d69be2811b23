"""``mlx-mtp serve``: tools, tool calls and logprobs.

Tools run on a fixture model: SmolLM2-135M's weights and tokenizer with a
Qwen2.5-style chat template that renders ``tools`` (the same ``<|im_start|>``
turns; mlx-lm's ``json_tools`` parser reads its ``<tool_call>`` blocks), in a
temporary folder, no network. A real request checks that the template renders
the tools into the prompt; since a model this small does not call a tool on
its own, the parsing is checked by forcing the answer's text at the worker's
boundary (the bound model's ``stream_generate``). Logprobs run on the plain
embedded model: a lossless method's equal plain decoding's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import openai
import pytest
from test_server import KEY, raw, serving

#: a Qwen2.5-style template with tools (Qwen2.5-Instruct's, trimmed of its
#: default system prompt)
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
N = 8


@pytest.fixture(scope="module")
def tool_model(smollm, tmp_path_factory) -> Path:
    """A model folder: SmolLM2's files, its tokenizer_config.json with the
    tool template above."""
    folder = tmp_path_factory.mktemp("smollm-tools")
    for f in Path(smollm.path).iterdir():
        if f.is_file() and f.name != "tokenizer_config.json":
            os.symlink(f, folder / f.name)
    cfg = json.loads((Path(smollm.path) / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def tool_server(tool_model):
    """(base_url, worker, client) of a server of the tool model (ntp)."""
    from mlx_mtp.server import Worker

    worker = Worker(str(tool_model), "ntp", dtype="float32", max_tokens=N, queue_size=2)
    worker.start()
    with serving(worker, api_key=KEY) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield base, worker, client
    worker.stop()


def test_the_fixture_has_a_tool_format(tool_server):
    tok = tool_server[1].loaded.tokenizer
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"


def test_tools_are_rendered_into_the_prompt_and_the_answer_is_the_apis(tool_server):
    from mlx_mtp.api import MTPModel
    from mlx_mtp.methods import make_method

    base, worker, client = tool_server
    model = str(worker.model_id)
    ref = MTPModel(worker.loaded, make_method("ntp"))
    with_tools = ref.encode(ASK, tools=[WEATHER])
    assert "get_weather" in ref.tokenizer.decode(with_tools)
    assert len(with_tools) > len(ref.encode(ASK)) + 20
    expected = ref.generate(ASK, max_tokens=N, tools=[WEATHER]).text
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=N)
    assert r.usage.prompt_tokens == len(with_tools)
    assert r.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=N, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    # tool_choice "none": rendered without the tools
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=N
    )
    assert r.usage.prompt_tokens == len(ref.encode(ASK))


def test_batched_tool_requests_render_the_tools_too(tool_server):
    from concurrent.futures import ThreadPoolExecutor

    from mlx_mtp.api import MTPModel
    from mlx_mtp.methods import make_method

    base, worker, client = tool_server
    asks = [ASK, [{"role": "user", "content": "And in Rome?"}]]
    ref = MTPModel(worker.loaded, make_method("ntp"))
    expected = [ref.generate(a, max_tokens=N, tools=[WEATHER]).text for a in asks]
    worker.max_batch = 2
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(
                    lambda a: client.chat.completions.create(
                        model=str(worker.model_id), messages=a, tools=[WEATHER], max_tokens=N
                    ),
                    asks,
                )
            )
    finally:
        worker.max_batch = 1
    assert [r.choices[0].message.content for r in answers] == expected
    assert all(r.usage.prompt_tokens == len(ref.encode(a, tools=[WEATHER]))
               for r, a in zip(answers, asks))  # fmt: skip
    assert any(r.model_extra["mtp"]["method"] == "ntp(batch)" for r in answers)


def test_a_conversation_with_a_tool_call_and_its_result_renders(tool_server):
    base, worker, client = tool_server
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(
        model=str(worker.model_id), messages=history, tools=[WEATHER], max_tokens=2
    )
    # the template gets the arguments as an object (as mlx_lm.server gives them)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    m = worker._models[worker.default_key]
    tokens = m.encode(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}, history[2]],
        tools=[WEATHER],
    )
    text = m.tokenizer.decode(tokens)
    assert '"arguments": {"city": "Paris"}' in text and "18 C, sunny" in text
    assert r.usage.prompt_tokens == len(tokens)


#: the answer forced at the worker's boundary: text, a call split across pieces
#: (the markers too), more text, a second call
FORCED = [
    "Let me check.",
    "<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool_',
    "call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>',
]


@pytest.fixture
def forced(tool_server, monkeypatch, request):
    """The tool model's default method answers :data:`FORCED` (or the
    pieces given as the fixture's parameter), then EOS."""
    from mlx_mtp.api import Chunk
    from mlx_mtp.decoding import GenerationStats

    worker = tool_server[1]
    m = worker._models[worker.default_key]
    seen = {}
    pieces = getattr(request, "param", FORCED)

    def fake(prompt, tools=None, **kw):
        seen["tools"] = tools
        st = GenerationStats(method="ntp", prompt_tokens=len(m.encode(prompt, tools=tools)))
        for i, text in enumerate(pieces):
            st.generated_tokens = st.forward_passes = i + 1
            last = i == len(pieces) - 1
            yield Chunk(text, [1], st, "stop" if last else None)

    monkeypatch.setattr(m, "stream_generate", fake)
    return seen


def _check_calls(calls):
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Lyon"},
    ]
    assert all(c.type == "function" and c.id for c in calls)
    assert calls[0].id != calls[1].id


def test_tool_calls_are_parsed_from_the_answer(tool_server, forced):
    base, worker, client = tool_server
    r = client.chat.completions.create(model=str(worker.model_id), messages=ASK, tools=[WEATHER])
    assert forced["tools"] == [WEATHER]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    _check_calls(choice.message.tool_calls)


def test_tool_calls_stream_as_delta_tool_calls(tool_server, forced):
    base, worker, client = tool_server
    chunks = list(
        client.chat.completions.create(
            model=str(worker.model_id), messages=ASK, tools=[WEATHER], stream=True
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check."
    _check_calls(calls)
    assert [t.index for t in calls] == [0, 1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("<tool" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_without_tools_the_same_answer_is_text(tool_server, forced):
    base, worker, client = tool_server
    r = client.chat.completions.create(model=str(worker.model_id), messages=ASK)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "".join(FORCED)


def test_tool_requests_that_cannot_be_honoured_are_400(tool_server):
    base, worker, _ = tool_server
    ok = {"model": str(worker.model_id), "messages": ASK, "tools": [WEATHER], "max_tokens": 2}
    cases = [
        (dict(ok, tool_choice="required"), "tool_choice"),
        (dict(ok, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
         "tool_choice"),
        (dict(ok, tools=[{"type": "retrieval"}]), "tools[0]"),
        (dict(ok, functions=[WEATHER["function"]]), "functions"),
        (dict(ok, response_format={"type": "json_schema", "json_schema": {}}),
         "response_format"),
    ]  # fmt: skip
    for body, param in cases:
        status, _, err = raw(base, "POST", "/v1/chat/completions", body)
        assert status == 400 and err["error"]["param"] == param, (body, err)
    status, _, r = raw(
        base, "POST", "/v1/chat/completions",
        dict(ok, response_format={"type": "text"}, parallel_tool_calls=False),
    )  # fmt: skip
    assert status == 200, r


# ------------------------------------------------------------------ logprobs
def test_chat_logprobs_of_a_lossless_method_equal_plain_decodings(tool_server):
    base, worker, client = tool_server
    model = str(worker.model_id)
    got = {}
    for method in ("ntp", "pld"):
        r = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=N, logprobs=True, top_logprobs=2,
            extra_body={"mtp": {"method": method}},
        )  # fmt: skip
        content = r.choices[0].logprobs.content
        assert "".join(e.token for e in content) == r.choices[0].message.content
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
                   for e in content)  # fmt: skip
        got[method] = content
    np.testing.assert_allclose(
        [e.logprob for e in got["pld"]], [e.logprob for e in got["ntp"]], atol=1e-4
    )
    # streamed: the same entries, chunk by chunk
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=N, logprobs=True, top_logprobs=2, stream=True
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in entries] == [e.token for e in got["ntp"]]
    np.testing.assert_allclose(
        [e.logprob for e in entries], [e.logprob for e in got["ntp"]], atol=1e-4
    )
    # not asked: null
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_are_openais_legacy_shape(tool_server):
    base, worker, _ = tool_server
    body = {"model": str(worker.model_id), "prompt": "The capital of France is",
            "max_tokens": 4, "logprobs": 3}  # fmt: skip
    status, _, r = raw(base, "POST", "/v1/completions", body)
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    # each token as decoded alone (the answer's text drops the first one's leading space)
    assert "".join(lp["tokens"]).strip() == r["choices"][0]["text"].strip()
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"])
    assert all(len(t) <= 3 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0


def test_logprob_requests_run_alone_and_lossy_methods_refuse(tool_server):
    from mlx_mtp.server.protocol import parse_request
    from mlx_mtp.server.worker import Job

    base, worker, _ = tool_server
    req = parse_request(
        {"model": "m", "messages": ASK, "logprobs": True, "mtp": {"method": "pld"}}, "chat"
    )
    worker.max_batch = 4
    try:
        assert worker.batchable(Job(req, emit=lambda e: None)) is None
        req.logprobs = None
        assert worker.batchable(Job(req, emit=lambda e: None)) == "pld"
    finally:
        worker.max_batch = 1
    body = {"model": str(worker.model_id), "messages": ASK, "logprobs": True,
            "mtp": {"method": "clp", "mode": "paper"}}  # fmt: skip
    status, _, err = raw(base, "POST", "/v1/chat/completions", body)
    assert status == 400 and "lossy" in err["error"]["message"], err


#: Qwen2.5-Coder-Instruct's way: the call's JSON alone in a fenced block
BARE = ["```", 'json\n{"name": "get_weather",', ' "arguments": {"city": "Paris"}}\n', "```"]


@pytest.mark.parametrize("forced", [BARE], indirect=True, ids=["fenced-json"])
def test_a_call_without_markers_is_read_as_a_tool_call(tool_server, forced):
    base, worker, client = tool_server
    model = str(worker.model_id)
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


CODE = ["```", "python\nprint(", "1)\n```"]
NOT_A_CALL = ['{"city": ', '"Paris"}']


@pytest.mark.parametrize("forced", [CODE, NOT_A_CALL], indirect=True, ids=["code", "json"])
def test_other_answers_stay_content_streamed_as_they_come(tool_server, forced):
    base, worker, client = tool_server
    model = str(worker.model_id)
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER])
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    chunks = list(
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], stream=True)
    )
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == text
    if text.startswith("```python"):  # sent before the answer ended
        assert len(deltas) >= 2 and deltas[0] == "```python\nprint("


def test_bare_calls_are_read_only_from_whole_answers_that_are_calls():
    from mlx_mtp.server.tools import bare_calls, may_be_bare_call

    names = {"get_weather"}
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    for text in (json.dumps(call), f"```json\n{json.dumps(call)}\n```", f"[{json.dumps(call)}]"):
        assert bare_calls(text, names) == [call], text
    for text in (
        "Sure: " + json.dumps(call),  # other text
        json.dumps({"name": "run", "arguments": {}}),  # a tool not offered
        json.dumps({"name": "get_weather", "arguments": "Oslo"}),  # arguments not an object
        json.dumps({"name": "get_weather", "arguments": {}, "extra": 1}),
        f"```python\n{json.dumps(call)}\n```",
        "```json\n{",  # cut
    ):
        assert bare_calls(text, names) is None, text
    assert all(may_be_bare_call(t) for t in ("", "  ", "`", "```js", "```json\n", "{", "```\n["))
    assert not any(may_be_bare_call(t) for t in ("Hi", "```py", "```python\n", "```json\nx"))
