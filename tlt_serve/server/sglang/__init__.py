"""The SGLang dialect: ``/generate`` bodies (``protocol.py``), their validation into jobs
(``inputs.py``), the route with SGLang's ``meta_info`` (``routes.py``)."""
