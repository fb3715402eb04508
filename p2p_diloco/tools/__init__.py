"""Tools beside the commands: ``export`` (the global model of a checkpoint as a Hugging Face folder) and
``layers`` (the package's import rules, checked from the source)."""
