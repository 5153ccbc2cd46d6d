"""Fixtures every client test shares: an `openai` client on the server run.sh started, and
the one model it serves."""

import os

import openai
import pytest


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=os.environ["SPECULA_BASE_URL"] + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list()
    assert len(models.data) == 1
    return models.data[0].id
