"""``hf-openjev export``: merge the LoRA adapter into a merged checkpoint (``merge.py``), check it
(``verify.py``); ``cli.py`` is the command line. ``fp8.py``: FP8 exports (``export --fp8``, and
``hf-openjev quantize``, ``quantize_cli.py``)."""
