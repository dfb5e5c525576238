"""Type-checking tests: mypy checks the files here against the public signatures."""
