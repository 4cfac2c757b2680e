"""``hf-openjev export``: merge the LoRA adapter into a merged checkpoint (``merge.py``), check it
(``verify.py``); ``cli.py`` is the command line."""
