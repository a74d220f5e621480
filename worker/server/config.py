"""The serving API's configuration: where it listens, how it logs, and the limits that keep one client from holding
the process (body size, prompt length, read deadlines, connections, requests admitted at once).

Every limit has a default that a normal client never meets; each is a flag and a `TIDAL_*` variable like every other
field (`tidal.worker.config`). The header deadline and the connection limit apply to both listeners (serving and
control); the body, prompt and admission limits to the serving API only (weight uploads have their own chunk limit).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LogLevel = Literal["critical", "error", "warning", "info", "debug"]

# Room for a million-token prompt sent as token ids (up to 7 bytes each in JSON), far above any text prompt that fits
# a context: a larger body is refused before it is read.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="0.0.0.0", min_length=1, description="Address both APIs listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port of the serving API (0: any free port).")
    log_level: LogLevel = Field(default="info", description="Log level of the worker and its HTTP servers.")
    stream_write_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="A streaming client that accepts no data for this long is dropped and its request aborted.",
    )
    max_request_body_bytes: int = Field(
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        ge=1024,
        description="Largest request body of the serving API; a larger one is refused (413) before or while it is "
        "read.",
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Longest prompt in tokens, refused (400) beyond it; unset: only max_model_len limits it.",
    )
    header_read_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        description="A connection must deliver a request's headers within this from when it may send them (opened, "
        "or its previous response done); else 408 and the connection is closed (an idle one without the 408).",
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="The serving API must receive a request's whole body within this after its headers; else 408 "
        "and the connection is closed.",
    )
    max_connections: int = Field(
        default=2048,
        ge=1,
        description="Open connections per listener; requests on a connection beyond it are answered 503 with "
        "Retry-After and the connection is closed.",
    )
    max_concurrent_requests: int = Field(
        default=1024,
        ge=1,
        description="Generation requests admitted at once (being tokenized, queued or generating); more are "
        "answered 429 with Retry-After.",
    )
    overload_retry_after_s: int = Field(
        default=1, ge=1, description="Retry-After of requests refused for max_concurrent_requests or max_connections."
    )
    tokenizer_threads: int = Field(
        default=4,
        ge=1,
        le=256,
        description="Threads that render chat templates and tokenize prompts, so the event loop never does.",
    )
    allow_request_chat_template: bool = Field(
        default=False,
        description="Let chat requests replace the chat template or add tools/documents to it through "
        "chat_template_kwargs (renders Jinja the client wrote); off: such requests are refused (400).",
    )

    tool_call_parser: Literal["auto", "qwen", "llama", "mistral"] = Field(
        default="auto",
        description="How chat requests' tool calls are written and read: auto = the format of the model's "
        "architecture (Qwen2/3: <tool_call> tags; Llama: JSON objects; Mistral/Mixtral: [TOOL_CALLS] arrays), or "
        "one named for a model whose chat template uses another family's.",
    )

    gil_switch_interval_us: int = Field(
        default=5000,
        ge=100,
        le=1_000_000,
        description="How long (µs) a Python thread keeps the GIL while another waits for it (sys.setswitchinterval): "
        "the engine's step thread can wait this long behind the event loop. Default: CPython's own 5000.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value
