"""The official `anthropic` Python client against `target-host serve` (`/v1/messages`).

Run through tests/python/run.sh. Greedy answers are compared with `target-host generate` for
the same conversation, whole and streamed.
"""

import json
import os
import subprocess

import anthropic
import pytest

BASE_URL = os.environ["SPECULA_BASE_URL"]
BIN = os.environ["SPECULA_BIN"]
MODEL_PATH = os.environ["SPECULA_MODEL"]
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def client():
    return anthropic.Anthropic(base_url=BASE_URL, api_key="unused")


def generate(*args):
    out = subprocess.run(
        [BIN, "generate", "--model", MODEL_PATH, "--json", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def model_name():
    return os.path.splitext(os.path.basename(MODEL_PATH))[0]


def test_message_matches_generate(client):
    expected = generate("--chat", QUESTION, "--max-tokens", "24")
    msg = client.messages.create(
        model=model_name(),
        max_tokens=24,
        messages=[{"role": "user", "content": QUESTION}],
        # Greedy; sent as a body field (newer clients dropped the typed argument).
        extra_body={"temperature": 0},
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text"
    assert msg.content[0].text == expected["text"]
    assert msg.stop_reason == ("max_tokens" if expected["finish_reason"] == "length" else "end_turn")
    assert msg.usage.output_tokens == len(expected["token_ids"])


def test_stream_matches_whole(client):
    kwargs = dict(
        model=model_name(),
        max_tokens=24,
        messages=[{"role": "user", "content": QUESTION}],
        # Greedy; sent as a body field (newer clients dropped the typed argument).
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_errors_are_anthropic_errors(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model=model_name(),
            max_tokens=8,
            messages=[{"role": "wizard", "content": "hi"}],
        )
    assert "wizard" in str(err.value)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="claude-9", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
