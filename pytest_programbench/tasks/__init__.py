"""Step 1-2: the tasks (catalogue, selection, submissions) and their hidden-test archives."""
