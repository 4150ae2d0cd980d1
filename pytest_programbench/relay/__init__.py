"""The model relay: the host side, the tunnel into a sandbox and the bridge that runs inside it."""
