"""Step 7: the official evaluation driven through the Docker SDK, integrity checks, pinned wheels."""
