"""LangChain's OpenAI chat model against the server on the default model: `bind_tools(...).invoke` returns a
tool call and `with_structured_output(..., method="function_calling")` returns the pydantic model."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from .default_model import default_server
from .harness import ServerThread

langchain_openai = pytest.importorskip("langchain_openai")


class Person(BaseModel):
    """A person."""

    name: str = Field(description="The person's name")
    age: int = Field(ge=0, le=150, description="The person's age in years")


def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def chat(request: pytest.FixtureRequest) -> object:
    server: ServerThread = default_server(request)
    model = server.state.model_name()
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=model, temperature=0,
                                       max_tokens=80, max_retries=0)


def test_bind_tools_returns_a_tool_call(chat) -> None:
    message = chat.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str) and message.tool_calls[0]["id"]
    # auto (LangChain's default): a 200 answer, a tool call only if the model wrote one in its format
    auto = chat.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert all(call["name"] == "get_weather" for call in auto.tool_calls)


def test_with_structured_output_function_calling(chat) -> None:
    person = chat.with_structured_output(Person, method="function_calling").invoke("Invent a person.")
    assert isinstance(person, Person) and isinstance(person.age, int)
