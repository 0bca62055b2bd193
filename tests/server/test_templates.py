"""ChatTemplate: the default Gemma template renders as the built-in format; the sandbox holds."""

from __future__ import annotations

import datetime
import json

import gguf
import pytest
from jinja2.exceptions import SecurityError

from muser.server.templates import ChatTemplate
from muser.tokenizer import Tokenizer, gemma_chat_format

CONVERSATIONS = [
    [{"role": "user", "content": "x"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": " Hi\n"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Q?"}],
    [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"},
     {"role": "user", "content": "U"}, {"role": "system", "content": "T"}],
]


@pytest.fixture(scope="module")
def tokenizer(gguf_reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_reader)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_is_the_gemma_format(tokenizer: Tokenizer, messages: list[dict],
                                              add_generation_prompt: bool) -> None:
    assert tokenizer.chat_template is None  # the embedded GGUF carries none
    rendered = ChatTemplate(tokenizer).render(messages, add_generation_prompt)
    assert rendered == gemma_chat_format(messages, add_generation_prompt)


def test_template_helpers_and_sandbox(tokenizer: Tokenizer) -> None:
    t = ChatTemplate(tokenizer, "{{ bos_token }}{{ strftime_now('%Y') }}"
                     "{% if tools %}{{ tools | length }}{% endif %}")
    assert t.render([], tools=[{"type": "function"}]).endswith("1")  # leading BOS dropped
    assert not t.render([]).startswith("<bos>")
    context = ChatTemplate(tokenizer, "{% for m in messages %}{{ m.content }}{% break %}{% endfor %}"
                           "{{ enable_thinking }} {{ date_string }}")
    today = datetime.date.today().strftime("%d %b %Y")
    assert context.render([{"content": "a"}, {"content": "b"}]) == f"aTrue {today}"
    with pytest.raises(SecurityError):
        ChatTemplate(tokenizer, "{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(Exception, match="no system turns"):
        ChatTemplate(tokenizer, "{{ raise_exception('no system turns') }}").render([])


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")
FORCED = "{% for m in messages %}{{ m.content }}{% endfor %}{{ '<think>\\n' }}"  # always opens one
COHERE = ("{% for m in messages %}{{ m.content }}{% endfor %}<|START_OF_TURN_TOKEN|>"
          "<|CHATBOT_TOKEN|>{% if false %}<|START_THINKING|>{% endif %}")


@pytest.mark.parametrize("source, on, off", [
    (THINKING, "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (FORCED, "<think>\n", "<think>\n</think>"),
    (COHERE, "<|CHATBOT_TOKEN|>", "<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>"),
])
def test_reasoning_off(tokenizer: Tokenizer, source: str, on: str, off: str) -> None:
    """--reasoning off: enable_thinking false, and a thinking block still opened is closed."""
    messages = [{"role": "user", "content": "Q?"}]
    assert ChatTemplate(tokenizer, source).render(messages).endswith(on)
    thinking_off = ChatTemplate(tokenizer, source, thinking=False)
    assert thinking_off.render(messages).endswith(off)
    assert not thinking_off.render(messages, add_generation_prompt=False).endswith(off)


def test_firefunction_context(tokenizer: Tokenizer) -> None:
    """`datetime` and the tools as JSON in `functions`, as llama-server gives FireFunction v2."""
    t = ChatTemplate(tokenizer, "{{ datetime }}|{{ functions }}")
    tool = {"type": "function", "function": {"name": "f"}}
    today = datetime.date.today().strftime("%b %d %Y")
    assert t.render([]).startswith(today) and t.render([]).endswith("|")
    assert t.render([], tools=[tool]).split("|")[1] == json.dumps([tool], indent=2)


def test_enable_thinking_per_request(tokenizer: Tokenizer) -> None:
    """A request's chat_template_kwargs.enable_thinking over the server's --reasoning."""
    t = ChatTemplate(tokenizer, "{{ enable_thinking }}", thinking=True)
    messages = [{"role": "user", "content": "x"}]
    assert t.render(messages) == "True"
    assert t.render(messages, thinking=False) == "False"
    assert ChatTemplate(tokenizer, "{{ enable_thinking }}", thinking=False).render(
        messages, thinking=True) == "True"
