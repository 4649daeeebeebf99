"""The HTTP server: OpenAI-compatible and SGLang-native endpoints over the scheduler thread."""
