"""HTTP serving: OpenAI- and llama.cpp-compatible routes over one engine loop thread."""
