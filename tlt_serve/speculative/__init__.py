"""Speculative decoding: model-free pieces (chain verifier, n-gram proposer) and, later, drafters.

``verify``: the lossless acceptance rule for chain drafts (greedy exact match, speculative
rejection sampling under the request's own temperature / top-k / top-p / min-p).
``ngram``: a suffix-match proposer over a request's own tokens and a bounded shared corpus.
Both take plain values and return value objects; neither touches a model or a ``Request``.
"""
