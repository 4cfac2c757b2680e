"""``hf-openjev serve``: the Jev-compatible HTTP server. ``server.py`` (routes, errors), ``batcher.py``
(admission queue, batched forwards), ``strict_json.py`` (request bodies); ``cli.py`` is the command line."""
