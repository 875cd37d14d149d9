"""Control routes: health, info, abort, pause, cache, tokenizer and ``/metrics``
(``routes.py``); weight updates and versions (``weights.py``); the drafter: hot-swap,
training control and the trainer's feed (``drafter.py``); their bodies (``protocol.py``)."""
