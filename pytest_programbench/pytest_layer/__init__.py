"""The roof: everything pytest-shaped. The entry point (``plugin.py``), options, stash keys, markers, hookspecs, the
run's state and its checks (``run_state.py``), the session and its hooks, items, fixtures, reporting, the progress,
scheduling and xdist hooks, the run record and the front doors that run no session (``front_doors.py``). The floors
below (``pipeline/`` down to ``core/``) never import pytest's hooks or read its options."""
