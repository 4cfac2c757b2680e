"""Checkpoint formats: the files of a merged export, an FP8 export's shards, the published package and its base.

- :mod:`.files`: shard lists, safetensors headers, the tokenizer (a leaf: the loaders and the commands read it);
- :mod:`.manifest`: ``open_jev_export.json``; :mod:`.fp8_scheme`: an FP8 export's format and its two JSON blocks; :mod:`.package`: the published LoRA package and its base config;
- :mod:`.backbone`: a checkpoint's backbone and head as modules (the loaders' shared steps);
- :mod:`.safetensors_stream`, :mod:`.out_dir`: streaming tensor files and publishing an output directory;
- :mod:`.tiny`: the tiny random checkpoints the demo and the tests build.
"""
