"""Retired: the transformers bridge that lived here kept a second cache of its own. ``kvmodels.hf`` runs a
``transformers`` model on kvmodels' paged cache instead: ``paged_cache(model, policy)`` for
``model.generate(..., past_key_values=cache)``, ``compressed(model, policy)``, ``wrap_transformers(model)``
(docs/hf.md)."""

raise ImportError("kvpolicies.hf was retired: use kvmodels.hf — paged_cache(model, policy) for "
                  "model.generate(..., past_key_values=cache), or `with compressed(model, policy):` "
                  "(docs/hf.md)")
