"""kvpolicies: compose KV-cache eviction, layer-budget and merge policies by name.

    >>> from kvpolicies import compose
    >>> policy = compose("squeeze", "keyformer", budget=0.2)
"""
