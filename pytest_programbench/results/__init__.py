"""Step 8: the verdict, the run's summary and artifacts, the live progress and the HTML report."""
