"""Structured output over HTTP (router/openai_protocol.py) with the fake router of
test_http_api.py: OpenAI's response_format, vLLM's structured_outputs and its older
guided_* parameters all reach the GenerateRequest as sampling.structured_outputs."""

from __future__ import annotations

import json

import pytest
from test_http_api import client, router  # noqa: F401  (router: the fixture)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("path, extra, kind, value", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, "json", json.dumps(SCHEMA)),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "json_object", True),
    ("/v1/completions", {"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
    ("/v1/completions", {"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
    ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ("/v1/completions", {"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
    ("/v1/completions", {"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
])
def test_each_way_to_ask_reaches_the_request(router, path, extra, kind, value):  # noqa: F811
    body = ({"prompt": "Hi"} if path == "/v1/completions" else CHAT) | extra
    r = client(router).post(path, json=body)
    assert r.status_code == 200, r.text
    so = router.requests[0][0].sampling.structured_outputs
    assert so.WhichOneof("kind") == kind
    got = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    assert got == value


def test_text_response_format_asks_for_nothing(router):  # noqa: F811
    client(router).post("/v1/chat/completions", json=CHAT | {"response_format": {"type": "text"}})
    assert not router.requests[0][0].sampling.HasField("structured_outputs")
