"""Request bodies of the OpenAI and llama.cpp routes (strict pydantic) and their sampling."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from muser.core import SamplingParams

Prob = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Stop = Annotated[str, Field(min_length=1, max_length=256)]

MAX_STOPS = 16
MAX_MESSAGES = 1024
MAX_PROMPTS = 16
MAX_INT32 = 2**31 - 1


def _integral(value: Any) -> Any:
    """40.0 -> 40 (clients written for llama-server send whole numbers as floats)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


TopK = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class OpenAISampling(Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: Prob = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    seed: int | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    ignore_eos: bool = False
    user: str | None = None
    # NOTE: declared so that a request asking for them is refused (400 naming the field), not
    # answered as if it had not: no structured output yet
    response_format: None = None
    logit_bias: dict[str, Any] | None = None  # muser/server/logit_bias.py checks it

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, repeat_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAISampling):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            # NOTE: text parts joined by a blank line, as llama-server joins them for a template
            return "\n\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    tools: None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    verbose: bool = False  # llama-server's __verbose: the rendered prompt beside the reply
    # NOTE: llama-server extensions refused by name (no constrained decoding yet)
    grammar: None = None
    json_schema: None = None

    def chat(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them ('developer' is a system turn)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class PromptObject(Body):
    """llama-server's {"prompt_string": ...} prompt; multimodal_data is refused by name."""

    prompt_string: str
    multimodal_data: None = None


OnePrompt = str | list[int | str] | PromptObject
PromptItem = int | str | TokenIds | PromptObject


def split_prompts(prompt: str | PromptObject | list[PromptItem]) -> list[OnePrompt]:
    """llama-server's rules: text, an object, or a list of ids and texts (one sequence: each text
    part tokenized without BOS) is one prompt; any other list is a list of prompts."""
    if not isinstance(prompt, list):
        return [prompt]
    if all(isinstance(p, (int, str)) for p in prompt) and any(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


class LlamaCompletionRequest(Body):
    """llama.cpp's /completion body (its defaults)."""

    prompt: str | PromptObject | Annotated[list[PromptItem], Field(min_length=1)]
    n_predict: Annotated[int, Field(ge=-1, le=MAX_INT32)] = -1
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] = 0.8
    top_k: TopK = 40
    top_p: TopP = 0.95
    min_p: Prob = 0.05
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    repeat_last_n: Annotated[int, Field(ge=0)] = 64
    seed: int = -1
    stop: Annotated[list[Stop], Field(max_length=MAX_STOPS)] = []
    stream: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: Annotated[int, Field(ge=-1, le=-1)] = -1
    return_tokens: bool = False
    response_fields: Annotated[list[str], Field(max_length=64)] | None = None
    n_probs: Annotated[int, Field(ge=0, le=0)] = 0
    # NOTE: refused unless 0 (400 naming the field): llama.cpp's penalties are not applied here
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    grammar: None = None
    json_schema: None = None
    logit_bias: list[Any] | dict[str, Any] | None = None  # muser/server/logit_bias.py checks it

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        if len(split_prompts(value)) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return value

    @field_validator("n_predict")
    @classmethod
    def _not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("n_predict must be -1 (until the context is full) or >= 1")
        return value

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n, seed=None if self.seed < 0 else self.seed,
            stop=tuple(self.stop), ignore_eos=self.ignore_eos)


class ApplyTemplateRequest(Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    tools: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None

    def chat(self) -> list[dict[str, Any]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class TokenizeRequest(Body):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: list[int]


class SlotFileRequest(Body):
    """POST /slots/{id}?action=save|restore: a file name inside --slot-save-path."""

    filename: str
