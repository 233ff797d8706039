"""The OpenAI request bodies the front door accepts, as pydantic models (the one declaration of
every field, its type and its bounds), and OpenAI's error object (:class:`APIError`, what every
refusal of the front door raises).

Fields OpenAI defines that this server cannot honour are accepted at their neutral values
(``n=1``, ``best_of=1``, ``echo=false``, ``logprobs`` off, ``stop=[]``, ``logit_bias={}``,
penalties 0) and refused otherwise with a 400 that names them; unknown fields are refused (a typo
must not pass silently). Integers are bounded, so a huge value is a 400, never an overflow. A
known field sent as null takes its default, as OpenAI's nullable fields do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "validation_error",
    "MAX_TOKENS_LIMIT",
]

#: The largest ``max_tokens`` a request may name (the engine refuses what its pool cannot hold).
MAX_TOKENS_LIMIT = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1
MAX_PROMPTS = 64
MAX_SEED = (1 << 63) - 1


class APIError(Exception):
    """An answer in OpenAI's error object: ``status`` the HTTP status, ``kind`` the error type,
    ``code`` OpenAI's code (``invalid_value``, ``unsupported_parameter``, ``model_not_found``,
    ``invalid_api_key``, ...)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = "invalid_value",
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.code = message, status, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's first error as a 400 naming the parameter. Where that error is a list's
    failure as the text member of a ``str | list of parts`` union (``content``), the parts' own
    error is told instead: it names the field that is wrong (``messages.content.image_url``)."""
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "string_type" and isinstance(err.get("input"), list):
        base = tuple(err.get("loc", ()))[:-1]
        parts = [e for e in errors[1:] if tuple(e["loc"])[: len(base)] == base and _in_parts(e["loc"][len(base) :])]
        err = parts[0] if parts else err
    loc = list(err.get("loc", ()))
    path, name = (loc[:-1], [str(loc[-1])]) if err.get("type") == "extra_forbidden" else (loc, [])
    param = ".".join([*_field_path(path), *name]) or None
    if err.get("type") == "extra_forbidden":
        return APIError(f"unknown parameter: {param}", param=param, code="unknown_parameter")
    if err.get("type") == "missing":
        return APIError(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    value = err.get("input")
    shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
    return APIError(f"invalid value for {param}: {err.get('msg')} (got {shown})", param=param)


def _in_parts(loc) -> bool:
    """A location inside a member of a list of tagged unions (chat's content parts)."""
    return any(isinstance(x, str) and "tagged-union[" in x for x in loc) and len(loc) > 1


def _field_path(loc: list) -> list[str]:
    """The field names of a pydantic error's location: list indices left out, a tagged
    union's member (its tag) skipped, ending at the first other name pydantic gives a union's
    member (``prompt.str``: the parameter is ``prompt``)."""
    out, tag_next = [], False
    for x in loc:
        if isinstance(x, int):
            continue
        if tag_next:  # the member of a tagged union, named by its tag ("image_url")
            tag_next = False
            continue
        if "tagged-union[" in x:
            tag_next = True
            continue
        if x not in _FIELD_NAMES:
            break
        out.append(x)
    return out


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What completions and chat completions share."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)] = 0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    logit_bias: dict[str, float] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v in (None, "", []):
            return None
        raise ValueError("text stop sequences are not supported (use stop_token_ids, or an empty list)")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported (only an empty object)")
        return None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI's optional fields are nullable: null means the default (``"temperature": null``
        is 1, ``"max_tokens": null`` 16), as OpenAI's API takes them."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    def sampling(self) -> dict[str, Any]:
        out = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        if self.seed is not None:
            out["seed"] = self.seed
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text (``<PAGE>``/``<image*N>`` markup with the demo
    tokenizer), token ids, or a list of either (one completion each)."""

    prompt: (
        str
        | list[TokenId]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    echo: Literal[False] = False
    logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    suffix: Literal[""] | None = None
    image_features: list[list[float]] | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            if not p:
                raise APIError("prompt must be a non-empty string or token ids", param="prompt")
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if any(isinstance(x, str) and not x for x in p):
            raise APIError("prompt strings must not be empty", param="prompt")
        return list(p)


class ImageURL(_Strict):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class FileData(_Strict):
    file_data: str | None = None
    filename: Annotated[str, Field(max_length=256)] | None = None
    file_id: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class FilePart(_Strict):
    """OpenAI's PDF part: ``{"type": "file", "file": {"file_data": "data:application/pdf;base64,...",
    "filename": "doc.pdf"}}``."""

    type: Literal["file"]
    file: FileData


class InputFilePart(_Strict):
    """The Responses API's spelling, accepted in chat too: ``{"type": "input_file", "file_data": ...,
    "filename": ...}``."""

    type: Literal["input_file"]
    file_data: str | None = None
    filename: Annotated[str, Field(max_length=256)] | None = None
    file_id: str | None = None


ContentPart = Annotated[TextPart | ImagePart | FilePart | InputFilePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=256)] | None = None
    name: Annotated[str, Field(max_length=64)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def attachments(self) -> list[ImagePart | FilePart | InputFilePart]:
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if not isinstance(p, TextPart)]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=512)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    #: the document options of dash-trt ocr, for messages with images or files
    crop: Literal["auto", "on", "off"] | None = None
    #: each page's token budget (default: dash_trt.documents.budget.DEFAULT_MAX_PAGE_TOKENS)
    max_page_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


#: Every field name of the request models (what a parameter's path in an error is made of).
_FIELD_NAMES = frozenset(
    name
    for m in (StreamOptions, CompletionRequest, ChatCompletionRequest, ChatMessage, ImageURL, FileData)
    + (TextPart, ImagePart, FilePart, InputFilePart)
    for name in m.model_fields
)
