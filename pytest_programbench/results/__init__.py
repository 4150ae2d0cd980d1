"""Step 8: the verdict, the run's summary and artifacts, the live progress and the HTML report; the corrected score
(``corrected``: the official scoring with test names compared canonically) and the comparison of two runs."""
