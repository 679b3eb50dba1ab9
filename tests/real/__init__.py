"""Tests against real engines (llama-server, vLLM) behind the sidecar; see scripts/setup-real-engines.sh."""
