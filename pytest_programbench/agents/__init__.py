"""Step 5: the agents (commands, presets, mini-swe-agent), the prompt and the agent's log."""
