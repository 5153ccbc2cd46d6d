"""The official `openai` Python client against `target-host serve`.

Run through tests/python/run.sh, which starts the server and sets SPECULA_BASE_URL,
SPECULA_BIN and SPECULA_MODEL. Every greedy answer is compared with `target-host generate`
for the same request: the server must add nothing and lose nothing.
"""

import json
import os
import subprocess

import openai
import pytest

BIN = os.environ["SPECULA_BIN"]
MODEL_PATH = os.environ["SPECULA_MODEL"]
QUESTION = "What is the capital of France? Answer in one sentence."


def generate(*args):
    """`target-host generate ... --json` as a dict."""
    out = subprocess.run(
        [BIN, "generate", "--model", MODEL_PATH, "--json", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def test_chat_completion_matches_generate(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    expected = generate("--chat", QUESTION, "--max-tokens", "24")
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert reply.usage.completion_tokens == len(expected["token_ids"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_chat_matches_whole(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    expected = generate("--chat", QUESTION, "--max-tokens", "24")
    assert "".join(pieces) == expected["text"]
    assert finish == expected["finish_reason"]
    assert usage is not None and usage.completion_tokens == len(expected["token_ids"])


def test_completion_with_logprobs(client, model):
    prompt = "The capital of France is"
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    expected = generate("--prompt", prompt, "--max-tokens", "8")
    choice = reply.choices[0]
    assert choice.text == expected["text"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(expected["token_ids"])
    assert len(lp.token_logprobs) == len(lp.tokens)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        # Greedy picks the most likely token.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert chosen <= 0.0


def test_bad_request_raises(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], n=2
        )
    assert err.value.body["param"] == "n"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_unsupported_or_out_of_range_is_a_400(client, model, extra, param):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    kwargs.update(extra)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs)
    assert err.value.body["param"] == param


def test_token_id_prompt(client, model):
    prompt = "The capital of France is"
    by_text = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    ids = generate("--prompt", prompt, "--max-tokens", "1")["prompt_ids"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
