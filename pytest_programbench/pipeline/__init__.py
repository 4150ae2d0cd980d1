"""A task's run, step by step, below the pytest layer: ``task_run.py`` (``TaskRun``: one task's state and each step's
work, which the fixtures of ``pytest_layer/fixtures.py`` call), ``model_relay.py`` (``TaskRelay``: the task's model
relay and what it recorded), ``room.py`` (the disk one task needs) and ``run_context.py`` (what a run hands a
``TaskRun``: a protocol, not the session object)."""
