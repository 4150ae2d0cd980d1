"""The ground floor: the run's vocabulary, pytest-free, imported by every floor above and importing none of them.

``settings`` (every option's parsed value and default), ``task_key`` (one item: a task, its attempt or gold run),
``run_identity`` (a run's id, directory, marker and fingerprint), ``cache`` (where the plugin keeps what outlives a
run) and ``environment`` (the one table of environment variables the harness reads).
"""
