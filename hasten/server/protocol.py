"""Request bodies of the OpenAI-compatible API, as pydantic models.

The field constraints here are the first line of input validation: anything outside
them becomes a 400 with an OpenAI-style error body, and they are what `/openapi.json`
publishes, so the schema and the server's real behaviour cannot drift apart.
Responses are built as plain dicts (see `responses.py`) because they are produced per
token on the hot path and `orjson` serialises a dict faster than a model round-trip.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_N = 16
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    # Unknown fields are accepted and ignored (like vLLM); types are strict ("yes" is no bool,
    # 1.5 no int); NaN and infinities are rejected.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaSpec(_Body):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="Served model name; omit to use the served model.")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="-1 or 0 disables.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX, description="Lower runs first.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS,
        description="Token id (as a string) -> value added to its logit before sampling, in [-100, 100].")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256,
        description="Requests share cached prompt prefixes only with requests of the same salt (vLLM).")


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=64)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: None = Field(None, description="Not supported; must be omitted or null.")
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
MAX_TOOLS = 128


class FunctionDef(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments object.")
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Body):
    name: str
    arguments: str = Field(description="The arguments as a JSON text.")


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="Assistant messages only.")
    tool_call_id: str | None = Field(None, description="Tool messages: the call this answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool = True


class InputTextPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponseMessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputTextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class ResponseFunctionOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


ResponseInputItem = ResponseMessageItem | ResponseFunctionCallItem | ResponseFunctionOutputItem


class ResponseTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)


class ResponseTextConfig(_Body):
    format: ResponseTextFormat | None = None


class ResponseFunctionTool(_Body):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseNamedToolChoice(_Body):
    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(_Body):
    """POST /v1/responses (stateless: no stored responses)."""

    model: str | None = None
    input: NonEmptyStr | Annotated[list[ResponseInputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: ResponseTextConfig | None = None
    tools: list[ResponseFunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(None, description="Not supported (stateless): 400 if given.")
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


MAX_EMBED_INPUTS = 2048


class EmbeddingRequest(_Body):
    """/v1/embeddings (OpenAI), with vLLM's `truncate_prompt_tokens` and `add_special_tokens`."""

    model: str | None = Field(None, description="Served model name; omit to use the served model.")
    input: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                    Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector, base64-encoded.")
    dimensions: int | None = Field(None, ge=1, description="Only the model's own size is accepted.")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep at most this many tokens of each input (-1: the model's maximum); "
                                 "without it a longer input is a 400.")
    add_special_tokens: bool = Field(True, description="For text inputs; token ids are used as given.")


# ---- response shapes, for the OpenAPI document only (responses are serialised as dicts) ----


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    timing: dict[str, float | None] | None = Field(
        None, description="Seconds spent queued, in prefill, in decode, and in total.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class VersionResponse(BaseModel):
    version: str
