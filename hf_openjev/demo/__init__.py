"""``hf-openjev demo``: the command (``cli.py``) that builds a tiny random checkpoint and answers requests with it."""
