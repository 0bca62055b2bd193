"""Gemma 4's tool and thinking markers (control tokens), shared by the parser that reads its
calls (tool_gemma4.py) and the grammar that writes them (tool_gemma4_grammar.py)."""

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
THINK_OPEN, THINK_CLOSE = "<|channel>", "<channel|>"
QUOTE = '<|"|>'
