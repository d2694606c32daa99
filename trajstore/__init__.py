"""trajstore: an event-sourced trajectory store and replay service for RL of LLM agents."""
