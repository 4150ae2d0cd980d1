"""Where things are inside an agent's sandbox: the one copy the host side uses.

``proxy/daemon.py`` runs inside the container as a single stdlib-only script and keeps its own copy;
tests/test_sandbox.py pins it equal to this one.
"""

from __future__ import annotations

AGENT_NAME = "pbagent"  # the unprivileged user the agent runs as
AGENT_UID = 1777
WORKSPACE = "/workspace"
SRC_DIR = WORKSPACE + "/src"  # the agent's, empty at the start; packed as the submission
DOCS_DIR = WORKSPACE + "/docs"  # everything the image had in /workspace but the executable, read-only
BINARY_PATH = WORKSPACE + "/binary"  # the proxy client that runs the reference
PROMPT_PATH = WORKSPACE + "/prompt.md"
PROXY_DIR = "/var/lib/pb-proxy"  # 0700 root: the reference, the daemon, the call log
RELAY_BRIDGE_PATH = "/usr/local/lib/pb-relay/relay_bridge.py"  # root-owned, not writable by the agent
RELAY_PORT = 47801  # the container-loopback port the relay bridge listens on
