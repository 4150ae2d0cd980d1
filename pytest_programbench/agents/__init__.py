"""Step 5: the agents (commands, presets, mini-swe-agent) and the prompt (the agent's log is the sandbox's)."""
