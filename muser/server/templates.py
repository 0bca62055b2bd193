"""ChatTemplate: a Jinja chat template rendered in a sandbox, as llama-server renders them.

The source is --chat-template (Jinja, or the name of one of NAMED) / --chat-template-file, else
the GGUF's tokenizer.chat_template, else GEMMA: the Gemma 3 turn format
(muser.tokenizer.gemma_chat_format) written in Jinja."""

from __future__ import annotations

import datetime
import json
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from muser.tokenizer import Tokenizer

GEMMA = r"""{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {%- set ns.system = ns.system ~ (m.content | trim) -%}
  {%- else -%}
    {%- set role = 'model' if m.role == 'assistant' else m.role -%}
    {{- '<start_of_turn>' ~ role ~ '\n' -}}
    {%- if ns.system and role != 'model' -%}
      {{- ns.system ~ '\n\n' -}}
      {%- set ns.system = '' -%}
    {%- endif -%}
    {{- (m.content | trim) ~ '<end_of_turn>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""

# NOTE: llama-server's built-in formats of these names, as Jinja
NAMED = {
    "gemma": GEMMA,
    "chatml": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "llama3": "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
              "{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "command-r": "{% set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', "
                 "'assistant': '<|CHATBOT_TOKEN|>'} %}{% for m in messages %}"
                 "<|START_OF_TURN_TOKEN|>{{ tokens[m.role] }}{{ m.content | trim }}"
                 "<|END_OF_TURN_TOKEN|>{% endfor %}{% if add_generation_prompt %}"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}",
}


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _close_thinking(text: str, source: str) -> str:
    """Thinking off, as llama-server's --reasoning off leaves a prompt: a thinking block the
    template opens anyway (DeepSeek R1, QwQ) is closed; a template with Command R7B's thinking
    tokens gets an empty block."""
    if text.endswith("<think>\n"):
        return text + "</think>"
    if "<|START_THINKING|>" in source and text.endswith("<|CHATBOT_TOKEN|>"):
        return text + "<|START_THINKING|><|END_THINKING|>"
    return text


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer, source: str | None = None,
                 thinking: bool = True) -> None:
        """source: Jinja text or a name in NAMED (None: the GGUF's template, else GEMMA);
        thinking: the templates' enable_thinking (False: --reasoning off). A template that does
        not parse raises jinja2.TemplateError."""
        self.thinking = thinking
        source = source or tokenizer.chat_template or GEMMA
        self.source = NAMED.get(source, source)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self._template = env.from_string(self.source)
        self._bos = tokenizer.decode([tokenizer.bos_id])
        self._eos = tokenizer.decode([tokenizer.eos_id])
        self._drop_bos = tokenizer.add_bos

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               continue_final_message: bool = False, thinking: bool | None = None) -> str:
        """The prompt text, without the leading BOS that encoding adds. continue_final_message:
        the text ends inside the last message (it is continued, not answered); thinking: the
        request's enable_thinking (None: the server's). Raises
        TemplateError (or anything the template raises) on a conversation it refuses."""
        if continue_final_message:
            text = self.render(messages, False, tools, thinking=thinking)
            final = messages[-1]["content"].strip()
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise TemplateError("continue_final_message: the template does not render the "
                                    "final message's text verbatim")
            return text[:cut + len(final)]
        # NOTE: llama-server's template context: enable_thinking, today's date as date_string,
        # and for templates written for FireFunction v2 `datetime` and the tools as `functions`
        thinking = self.thinking if thinking is None else thinking
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, bos_token=self._bos, eos_token=self._eos,
                                     enable_thinking=thinking,
                                     date_string=_strftime_now("%d %b %Y"),
                                     datetime=_strftime_now("%b %d %Y %H:%M:%S GMT"),
                                     functions=json.dumps(tools, indent=2) if tools else "")
        if self._drop_bos and text.startswith(self._bos):
            text = text[len(self._bos):]
        if not thinking and add_generation_prompt:
            text = _close_thinking(text, self.source)
        return text
