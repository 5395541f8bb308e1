"""Rollout: prompts from verifiable tasks, generation engines, and the records passed between them."""
