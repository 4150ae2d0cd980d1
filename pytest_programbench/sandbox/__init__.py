"""Step 4: the agent's container and the proxy that serves the reference binary (``proxy/`` runs inside it)."""
