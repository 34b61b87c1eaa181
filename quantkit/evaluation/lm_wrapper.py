"""An lm-eval model that wraps another: what quantkit's request cache and per-task progress share."""

from __future__ import annotations

from lm_eval.api.model import LM


class DelegatingLM(LM):
    """Passes every attribute it does not define (device, tokenizer_name, get_model_info, ...) to ``inner``."""

    def __init__(self, inner: LM):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        if name == "inner":  # not set yet (unpickling, copying): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size
