"""``dflash serve`` with structured outputs: ``response_format`` (json_object, json_schema), the
server's ``regex`` / ``grammar`` fields, the OpenAI SDK's ``parse(response_format=Model)``, and the
400s bad grammars get. The real server on localhost (tiny models), the official client."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from test_server import KIND, MODEL_NAME, launch_server

pytestmark = pytest.mark.slow  # a server subprocess and the models, for many seconds

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from dflash.grammar import Grammar  # noqa: E402


class Verdict(pydantic.BaseModel):
    """Short by construction (no free strings): a tiny random target finishes it."""

    ok: bool
    colour: Literal["red", "green", "blue"]
    count: int = pydantic.Field(ge=0, le=99)


SCHEMA = {**Verdict.model_json_schema(), "additionalProperties": False}  # as strict mode sends it


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair(KIND)
    with launch_server(target, draft, tmp_path_factory.mktemp("structured") / "server.log",
                       "--max-concurrency", "2") as s:
        yield s


def chat(text):
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL_NAME, messages=chat("Judge it."),
                                      response_format=Verdict, max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_answer_is_the_library_grammar_answer(client, reference):
    text, _, _ = reference(chat("Judge it."), max_tokens=64,
                           grammar=Grammar.json_schema(SCHEMA))
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=chat("Judge it."), max_tokens=64, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].message.content == text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_sampled_streamed_and_completions_answers_validate(client):
    for seed in range(3):
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=chat("Judge it."), max_tokens=64, temperature=1.0,
            seed=seed, stream=True,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "verdict", "schema": SCHEMA}})
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    r = client.completions.create(model=MODEL_NAME, prompt="A verdict:", max_tokens=64,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_json_object_regex_and_lark(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Any object."),
                                       max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Yes or no?"),
                                       max_tokens=16, temperature=0,
                                       extra_body={"regex": "(yes|no)[.!]"})
    assert re.fullmatch(r"(yes|no)[.!]", r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Count."), max_tokens=16,
                                       temperature=0,
                                       extra_body={"grammar": 'start: ("one" | "two") " apple"'})
    assert r.choices[0].message.content in ("one apple", "two apple")


def test_max_tokens_cuts_with_finish_reason_length(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=chat("Judge it."), max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL_NAME, messages=chat("Judge it."),
                                      response_format=Verdict, max_tokens=3)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v",
                                                                 "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v"}}},
     "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "v", "schema": {"type": "string", "format": "bogus"}}}},
     "response_format.json_schema.schema", "bogus"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"regex": "[a-("}, "regex", "regex"),
    ({"grammar": "start: nowhere"}, "grammar", "nowhere"),
    ({"regex": "a", "grammar": "start: \"a\""}, "grammar", "give one"),
    ({"tools": [{"type": "function", "function": {
        "name": "lookup", "strict": True,
        "parameters": {"type": "object", "properties": {"q": {"type": "string",
                                                              "format": "bogus"}}}}}]},
     "tools[0].function.parameters", "lookup"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {
        "name": "lookup", "strict": True, "parameters": {"type": "object"}}}]},
     "response_format", "strict tools"),
])
def test_bad_grammars_are_400_naming_the_field(server, extra, param, words):
    body = {"model": MODEL_NAME, "messages": chat("x"), "max_tokens": 4, **extra}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_responses_text_format(client, server):
    r = client.responses.create(model=MODEL_NAME, input="Judge it.", max_output_tokens=64,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "verdict", "schema": SCHEMA,
                                    "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    parsed = client.responses.parse(model=MODEL_NAME, input="Judge it.", text_format=Verdict,
                                    max_output_tokens=64, temperature=0)
    assert isinstance(parsed.output_parsed, Verdict)
    bad = httpx.post(server["base"] + "/v1/responses", timeout=60, json={
        "model": MODEL_NAME, "input": "x",
        "text": {"format": {"type": "json_schema", "name": "v", "schema": {"type": "objekt"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema"


def test_responses_read_the_server_regex_and_grammar_fields(client, server):
    """``extra_body`` regex / grammar constrain a Responses answer as they do a chat answer (never
    an answer silently unconstrained); with ``text.format`` as well, a 400 naming the field."""
    r = client.responses.create(model=MODEL_NAME, input="Yes or no?", max_output_tokens=16,
                                temperature=0, extra_body={"regex": "(yes|no)[.!]"})
    assert re.fullmatch(r"(yes|no)[.!]", r.output_text)
    r = client.responses.create(model=MODEL_NAME, input="Count.", max_output_tokens=16,
                                temperature=0,
                                extra_body={"grammar": 'start: ("one" | "two") " apple"'})
    assert r.output_text in ("one apple", "two apple")
    bad = httpx.post(server["base"] + "/v1/responses", timeout=60, json={
        "model": MODEL_NAME, "input": "x", "regex": "a",
        "text": {"format": {"type": "json_object"}}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "regex" and "give one" in bad.json()["error"]["message"]
    bad = httpx.post(server["base"] + "/v1/responses", timeout=60,
                     json={"model": MODEL_NAME, "input": "x", "regex": "[a-("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"


WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"enum": ["Rome", "Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                          "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}


def strict_tools():
    return [{"type": "function", "function": {"name": "get_weather", "strict": True,
                                              "parameters": WEATHER_ARGS}},
            {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
                "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_strict_tool_arguments_match_the_tools_schema(client, choice):
    """A random-weight target cannot write a valid call on its own: with ``strict`` it must, and
    the arguments validate against the tool's ``parameters``."""
    r = client.chat.completions.create(model=MODEL_NAME, messages=chat("Weather in Rome?"),
                                       max_tokens=48, temperature=0, tools=strict_tools(),
                                       tool_choice=choice)
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0]
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_weather"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in strict_tools()}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # Sampled, and through the Responses API: the same guarantee.
    r = client.responses.create(model=MODEL_NAME, input="Weather in Oslo?", temperature=1.0,
                                max_output_tokens=48, tool_choice="required", tools=[
                                    {"type": "function", "name": "get_weather", "strict": True,
                                     "parameters": WEATHER_ARGS}])
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_ARGS)


XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call a tool as:\n<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
XML_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Rome", "Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}


# The call form of Mistral's templates (mlx-lm reads a template naming [TOOL_CALLS] as `mistral`).
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments }}{% endfor %}</s>{% else %}{{ m.content }}</s>{% endif %}"
    "{% endfor %}")


# GLM-4.5's and GLM-4.7's call form (mlx-lm reads a template naming <arg_key> as `glm47`).
GLM_TEMPLATE = (
    "{%- if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call a tool as:\n<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V"
    "</arg_value>\n</tool_call>{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")
TEMPLATES = {"xml": XML_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "glm": GLM_TEMPLATE}


@pytest.mark.parametrize("form", list(TEMPLATES))
def test_strict_tools_in_a_model_s_own_call_form_over_the_server(tiny_pair, tmp_path, form):
    """A target whose template writes Qwen3.5's XML call form (mlx-lm reads it as
    ``qwen3_coder``), Mistral's (``mistral``) or GLM's (``glm47``): a random-weight target with
    ``strict`` and
    ``tool_choice`` "required" makes a call mlx-lm's parser reads into arguments that validate,
    greedy and sampled."""
    import shutil

    target, draft = tiny_pair(KIND)
    xml_target = tmp_path / f"{form}-target"
    shutil.copytree(target, xml_target)
    config_file = xml_target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATES[form]
    config_file.write_text(json.dumps(config))
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True,
                                             "parameters": XML_ARGS}}
    with launch_server(xml_target, draft, tmp_path / "server.log") as s:
        client = openai.OpenAI(base_url=f"{s['base']}/v1", api_key="none", max_retries=0)
        for temperature in (0.0, 1.0):
            r = client.chat.completions.create(
                model=MODEL_NAME, messages=chat("Weather in Rome?"), max_tokens=96,
                temperature=temperature, tools=[tool], tool_choice="required")
            calls = r.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather", r.choices[0]
            jsonschema.validate(json.loads(calls[0].function.arguments), XML_ARGS)
