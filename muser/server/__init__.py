"""HTTP serving: OpenAI- and llama.cpp-compatible routes in front of one engine process."""
