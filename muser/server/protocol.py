"""Request bodies of the OpenAI and llama.cpp routes (strict pydantic) and their sampling."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from muser.core import MAX_LOGPROBS, SamplingParams
from muser.server.structured import LlamaStructured, OpenAIStructured
from muser.server.tool_request import ToolCall, ToolChoice, Tools

Prob = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Stop = Annotated[str, Field(min_length=1, max_length=256)]

MAX_STOPS = 16
MAX_MESSAGES = 1024
MAX_PROMPTS = 16
MAX_INT32 = 2**31 - 1
MAX_SAMPLES = 128  # n / best_of beyond this are refused here; the server's --max-n is lower

NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def draft_limit(speculative: bool | int | None) -> int | None:
    """A request's "speculative" -> SamplingParams.speculative (true: the engine's limit)."""
    if speculative is None or speculative is True:
        return None
    return 0 if speculative is False else speculative


def _integral(value: Any) -> Any:
    """40.0 -> 40 (clients written for llama-server send whole numbers as floats)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


TopK = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
TokenIds = Annotated[list[int], Field(min_length=1)]


# NOTE: a field that is not declared is refused (400 naming it); a field declared with type
# None (Unsupported) is known and refused unless null; a field pinned to one value (n: 1) is
# accepted only with the value whose behaviour this server has
Unsupported = None


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: Literal[False] = False  # no obfuscation padding is sent


class OpenAISampling(OpenAIStructured, Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # NOTE: llama-server's, on its OpenAI routes too: overrides max_tokens, -1 or more than
    # fits is the context's rest (ServerContext.n_predict)
    n_predict: Annotated[int, Field(ge=-1, le=MAX_INT32)] | None = None
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
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    ignore_eos: bool = False
    user: str | None = None  # an end user's id: no effect on the output (as at OpenAI)
    logit_bias: dict[str, Any] | None = None  # muser/server/logit_bias.py checks it
    # speculative decoding (muser's): false or 0 turns it off for this request, a number caps
    # its draft tokens per step; outputs are the same either way
    speculative: bool | Annotated[int, Field(ge=0, le=MAX_INT32)] | None = None

    def sampling(self, max_tokens: int, n: int = 1, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, repeat_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, n=n, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, speculative=draft_limit(self.speculative))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAISampling):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | (
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with echo only (prompt scoring)
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    suffix: Unsupported = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # assistant's
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # tool's
    # an earlier reply's thinking (llama-server's and DeepSeek's name), for templates that
    # render it
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("reasoning_content: only an assistant message carries it")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, and only a tool message")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            # NOTE: text parts joined by a blank line, as llama-server joins them for a template
            return "\n\n".join(part.text for part in self.content)
        return self.content or ""

    def turn(self) -> dict[str, str]:
        """The message as the chat template takes it ('developer' is a system turn)."""
        turn = {"role": "system" if self.role == "developer" else self.role,
                "content": self.text()}
        if self.reasoning_content is not None:
            turn["reasoning_content"] = self.reasoning_content
        return turn


class TemplateKwargs(Body):
    """chat_template_kwargs (vLLM's and llama-server's): the template variables a request may
    set; enable_thinking turns a template's thinking channel on or off for this request."""

    enable_thinking: bool | None = None


class ChatRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    # NOTE: tools: muser/server/tool_calls.py; the legacy functions / function_call are
    # refused by name (tools and tool_choice say the same)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Unsupported = None
    function_call: Unsupported = None
    # NOTE: OpenAI fields whose other values this server does not have
    store: Literal[False] | None = None  # nothing is stored
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Unsupported = None
    metadata: Unsupported = None
    moderation: Unsupported = None
    prediction: Unsupported = None
    prompt_cache_key: Unsupported = None
    prompt_cache_options: Unsupported = None
    prompt_cache_retention: Unsupported = None
    reasoning_effort: Unsupported = None
    safety_identifier: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    chat_template_kwargs: TemplateKwargs | None = None
    verbose: bool = False  # llama-server's __verbose: the rendered prompt beside the reply
    # llama-server's: the slot to run in (-1: any; the route checks the range), timings on
    # every streamed chunk, prompt-progress chunks while the prompt prefills (stream only)
    id_slot: Annotated[int, Field(ge=-1)] = -1
    timings_per_token: bool = False
    return_progress: bool = False


class PromptObject(Body):
    """llama-server's prompt object: {"prompt_string": text} or {"content": [text parts]}
    (their texts joined as they are); multimodal_data is refused by name."""

    prompt_string: str | None = None
    content: Annotated[list[TextPart], Field(min_length=1)] | None = None
    multimodal_data: None = None

    @model_validator(mode="after")
    def _one_text(self) -> PromptObject:
        if (self.prompt_string is None) == (self.content is None):
            raise ValueError("a prompt object has prompt_string or content (text parts), "
                             "one of them")
        return self

    @property
    def text(self) -> str:
        if self.prompt_string is not None:
            return self.prompt_string
        return "".join(part.text for part in self.content or ())


OnePrompt = str | list[int | str] | PromptObject
# NOTE: in a list of prompts, a prompt may itself mix ids and texts
PromptItem = int | str | TokenIds | Annotated[list[int | str], Field(min_length=1)] | PromptObject


def split_prompts(prompt: str | PromptObject | list[PromptItem]) -> list[OnePrompt]:
    """llama-server's rules: text, an object, or a list of ids and texts (one sequence: each text
    part tokenized without BOS) is one prompt; any other list is a list of prompts."""
    if not isinstance(prompt, list):
        return [prompt]
    if all(isinstance(p, (int, str)) for p in prompt) and any(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


class LlamaCompletionRequest(LlamaStructured, Body):
    """llama.cpp's /completion body (its defaults)."""

    prompt: str | PromptObject | Annotated[list[PromptItem], Field(min_length=1)]
    model: str | None = None
    n_predict: Annotated[int, Field(ge=-1, le=MAX_INT32)] = -1
    # NOTE: llama-server's aliases of n_predict, read when n_predict is not given
    max_tokens: Annotated[int, Field(ge=-1, le=MAX_INT32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=-1, le=MAX_INT32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] = 0.8
    top_k: TopK = 40
    top_p: TopP = 0.95
    min_p: Prob = 0.05
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    repeat_last_n: Annotated[int, Field(ge=-1)] = 64  # -1: the context size
    seed: int = -1
    stop: Annotated[list[Stop], Field(max_length=MAX_STOPS)] = []
    stream: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: Annotated[int, Field(ge=-1)] = -1  # -1: any slot (the route checks the range)
    # samples of each prompt (llama-server's child tasks; "n" read when n_cmpl is not given);
    # the route checks them against the slots
    n_cmpl: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    return_tokens: bool = False
    # NOTE: llama-server's choice of sampling inside the compute graph or after it; muser's
    # engine samples in one place, so both values give the same tokens and probabilities
    backend_sampling: bool = False
    response_fields: Annotated[list[str], Field(max_length=64)] | None = None
    n_probs: NumLogprobs = 0
    # llama.cpp's scope: over the last repeat_last_n ids of prompt + output
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: list[Any] | dict[str, Any] | None = None  # muser/server/logit_bias.py checks it
    # NOTE: llama.cpp's other samplers, accepted at the value that turns them off (what this
    # server does) and refused at any other; their sub-parameters act only when they are on
    typical_p: Annotated[float, Field(ge=1.0, le=1.0)] = 1.0
    dynatemp_range: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    dynatemp_exponent: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    top_n_sigma: Annotated[float, Field(le=0.0, allow_inf_nan=False)] = -1.0
    xtc_probability: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    xtc_threshold: Annotated[float, Field(allow_inf_nan=False)] = 0.1
    mirostat: Annotated[int, Field(ge=0, le=0)] = 0
    mirostat_tau: Annotated[float, Field(allow_inf_nan=False)] = 5.0
    mirostat_eta: Annotated[float, Field(allow_inf_nan=False)] = 0.1
    dry_multiplier: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    dry_base: Annotated[float, Field(allow_inf_nan=False)] = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: Annotated[list[str], Field(max_length=64)] | None = None
    min_keep: Annotated[int, Field(ge=0, le=1)] = 0  # at least one candidate always survives
    grammar_lazy: Literal[False] = False
    n_indent: Annotated[int, Field(ge=0, le=0)] = 0
    # with --context-shift: the prompt tokens after BOS a shift keeps (-1: all), the tokens it
    # drops (0: half of the rest); without it only the values that change nothing
    n_keep: Annotated[int, Field(ge=-1, le=MAX_INT32)] = 0
    n_discard: Annotated[int, Field(ge=0, le=MAX_INT32)] = 0
    n_cache_reuse: Annotated[int, Field(ge=0, le=0)] = 0
    t_max_predict_ms: Annotated[int, Field(ge=0, le=0)] = 0
    t_max_prompt_ms: Annotated[int, Field(ge=-1, le=0)] = -1
    timings_per_token: bool = False  # every streamed chunk carries timings
    return_progress: bool = False  # prompt-progress chunks while the prompt prefills (stream)
    post_sampling_probs: bool = False  # n_probs of the distribution drawn from, as probs
    lora: Annotated[list[Any], Field(max_length=0)] | None = None
    samplers: Unsupported = None
    # llama-server's draft settings: n_max caps the draft tokens per step (0: none); a draft
    # shorter than n_min is not verified
    spec_n_max: Annotated[int, Field(ge=0, le=MAX_INT32, alias="speculative.n_max")] = 16
    spec_n_min: Annotated[int, Field(ge=0, le=MAX_INT32, alias="speculative.n_min")] = 0
    # NOTE: a draft model's confidence floor; prompt lookup's drafts carry no probability
    spec_p_min: Annotated[float, Field(ge=0.0, le=1.0, alias="speculative.p_min")] = 0.75

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        if len(split_prompts(value)) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return value

    @field_validator("n_predict", "max_tokens", "max_completion_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (until the context is full) or >= 1")
        return value

    @property
    def num_predict(self) -> int:
        """n_predict, else its alias max_tokens, else max_completion_tokens (llama-server's)."""
        if "n_predict" in self.model_fields_set:
            return self.n_predict
        return next((v for v in (self.max_tokens, self.max_completion_tokens) if v is not None),
                    self.n_predict)

    @property
    def num_samples(self) -> int:
        """n_cmpl, else its alias n, else 1 (llama-server's)."""
        return next((v for v in (self.n_cmpl, self.n) if v is not None), 1)

    def sampling(self, max_tokens: int, context: int, slot: int | None = None, n: int = 1
                 ) -> SamplingParams:
        """context: the context size, llama.cpp's repeat_last_n = -1; slot: id_slot checked
        (None: any); n: the samples, checked."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
            repeat_last_n=context if self.repeat_last_n < 0 else self.repeat_last_n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            penalties_over_last_n=True, seed=None if self.seed < 0 else self.seed,
            stop=tuple(self.stop), ignore_eos=self.ignore_eos,
            logprobs=self.n_probs or None, post_sampling=self.post_sampling_probs and bool(
                self.n_probs), slot=slot, progress=self.return_progress,
            speculative=self.spec_n_max if "spec_n_max" in self.model_fields_set else None,
            min_drafts=self.spec_n_min, n_keep=self.n_keep, n_discard=self.n_discard, n=n)


MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request
EmbedInput = str | PromptObject | Annotated[list[PromptItem], Field(min_length=1,
                                                                  max_length=MAX_INPUTS)]


class EmbeddingRequest(Body):
    """/v1/embeddings (OpenAI's body) and /embedding (llama-server's, which also takes the
    prompts as `content`); the prompts as split_prompts reads a completion's."""

    input: EmbedInput | None = None
    content: EmbedInput | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # llama-server's: -1 none, 0 max-abs to the int16 range, 1 taxicab, 2 euclidean, p > 2 p-norm
    embd_normalize: Annotated[int, Field(ge=-1)] = 2


class ApplyTemplateRequest(Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    tools: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None

    def chat(self) -> list[dict[str, Any]]:
        return [m.turn() for m in self.messages]


class TokenizeRequest(Body):
    content: str
    add_special: bool = False
    parse_special: bool = True  # control-token texts become their ids (llama-server's default)
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: list[int]


class SlotFileRequest(Body):
    """POST /slots/{id}?action=save|restore: a file name inside --slot-save-path."""

    filename: str
