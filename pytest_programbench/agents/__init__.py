"""Step 5: the agent, run in the sandbox or driving it from the host.

``agent`` (:class:`AgentSpec`: what ``--pb-agent`` asked for; :class:`AgentRunner`: one task's agent window, from
the prompt written until the sandbox is frozen and stopped) runs a shell command or a preset: ``reference`` and
``replay:DIR`` itself, the CLI agents (codex, claude-code, opencode) through ``agent_presets`` (installed once per
machine with npm, copied into the sandbox, configured headless, their transcript copied out), the official scaffold
through ``mini_swe_agent`` (the ``[mini]`` extra, run in the worker against our sandbox). ``prompt`` renders the
agent's prompt (Jinja2, ``templates/prompt.md.j2``); ``command_check`` asks once, before the agent, whether its
command is there. The agent's log is the sandbox's (``sandbox/agent_log.py``).
"""
