"""vLLM's RL dialect: the routes TRL's ``VLLMClient`` and prime-rl send a vLLM server."""
