"""Step 7: the official evaluation driven through the Docker SDK.

``evaluation`` evaluates one submission (its steps in ``_Evaluation``) on ``container_layer`` (the official
``Evaluator`` over the SDK, batched steps from ``step_batch``), with the harness's probes: ``integrity`` flags,
``install_cache`` (recorded pip installs), ``rerunfailures`` (the pinned wheels), ``harness_material`` (what the
harness places in a container, verified), ``results_check``; ``audit`` and ``audit_plugin`` check that a passing
program still passes without reading the hidden tests (the corrected score is ``results/corrected.py``).
"""
