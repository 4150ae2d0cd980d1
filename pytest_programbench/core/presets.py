"""The CLI agent presets by name, as plain data: ``NAME[@VERSION]`` and each preset's default version. The presets
themselves (their npm packages, builds and command lines) are ``agents/agent_presets.py``'s; what a run's record or a
leaderboard entry says of its agent needs only this."""

from __future__ import annotations

# The npm version each preset installs when --pb-agent names it without @VERSION.
DEFAULT_VERSIONS: dict[str, str] = {"codex": "0.171.0", "claude-code": "2.1.332", "opencode": "1.18.33"}


def parse_preset(value: str) -> tuple[str, str] | None:
    """``NAME[@VERSION]`` of a CLI preset as (name, version), else ``None`` (an ordinary command); a version that is
    no npm version is a ValueError naming the expected form."""
    name, sep, version = value.strip().partition("@")
    if name not in DEFAULT_VERSIONS:
        return None
    version = version.strip() if sep else DEFAULT_VERSIONS[name]
    if not version or any(c.isspace() or c in "/\\" for c in version):
        raise ValueError(f"expected {name}@VERSION with an npm version")
    return name, version
