"""``hf-openjev export``: merge the LoRA adapter into a merged checkpoint (``merge.py``), check it
(``verify.py``); ``cli.py`` is the command line. ``merge_fp8.py``: ``export --fp8`` (merge, then
:mod:`hf_openjev.fp8.quantize`); ``quantize_cli.py``: ``hf-openjev quantize``."""
