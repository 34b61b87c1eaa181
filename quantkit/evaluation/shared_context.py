"""lm-eval's in-process model with each multiple-choice context computed once.

lm-eval's ``HFLM`` scores a question's choices as separate sequences, context and continuation together, so the
context (most of the tokens: ARC-Easy's question against a few-token answer) runs once per choice. Here a batch of
questions runs its contexts once (right-padded), keeps their KV cache, and then every choice's continuation on its
own question's cache: lm-eval's answers ``(sum of the continuation's log-probabilities, whether greedy decoding
gives it)`` over about a third of the tokens on ARC, equal to ``HFLM``'s up to the rounding of differently shaped
matrix products (tests/test_shared_context.py). Rolling log-likelihoods, requests longer than the model's context
and models whose cache is not a plain per-layer key/value cache (``SHARED_CONTEXT_MODELS`` lists those held equal)
take ``HFLM``'s own path.

Generation is ``HFLM``'s own, with one change: a sequence stops when it has produced any of the task's stop strings.
lm-eval 0.4.13 builds one criterion per stop string, each true only once every sequence of the batch has produced
that same string (``models/utils_hf.py:74-129``), and transformers 5.17 ORs the criteria per sequence
(``StoppingCriteriaList.__call__``): a batch whose answers end on different stop strings (GSM8K's ``\n\n``, the
end-of-text token) ran to ``max_gen_toks``, 256 steps where the longest answer took 17. The answers are the same
tokens, cut at the same place (tests/test_shared_context.py); the steps after a sequence stopped were padding.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import transformers
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

Request = tuple[tuple[str, str] | None, list[int], list[int]]
SHARED_CONTEXT_MODELS = ("llama",)  # model types tests/test_shared_context.py holds equal to HFLM
# per forward, for --batch-size B requests: 2B questions' contexts (a context is most of a request's tokens), then
# 4B continuations on their cache (a few tokens each); measured at B = 16 (docs/eval.md)
QUESTIONS_PER_REQUEST, CONTINUATIONS_PER_REQUEST = 2, 4


class AnyStopString(transformers.StoppingCriteria):
    """lm-eval's stop-string criteria, combined per sequence: a sequence is done once any of them saw its string."""

    def __init__(self, criteria: list):
        self.criteria = criteria

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        for criterion in self.criteria:
            criterion(input_ids, scores)  # updates its per-sequence done_tracker, lm-eval's own lookback
        done = [any(c.done_tracker[i] for c in self.criteria) for i in range(input_ids.shape[0])]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class SharedContextHFLM(HFLM):
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """HFLM's generation, its stop-string criteria combined per sequence (the module's docstring says why)."""
        generate = self.model.generate

        def per_sequence(*args, stopping_criteria, **kwargs):
            return generate(*args, stopping_criteria=transformers.StoppingCriteriaList(
                [AnyStopString(list(stopping_criteria))]), **kwargs)

        self.model.generate = per_sequence
        try:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        finally:
            del self.model.generate

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        if (self.backend != "causal" or getattr(self.model.config, "model_type", None) not in SHARED_CONTEXT_MODELS
                or any(r[0] is None or len(r[1]) + len(r[2]) > self.max_length + 1 for r in requests)):
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, _) in enumerate(requests):
            groups.setdefault(tuple(context), []).append(i)
        ordered = sorted(groups.items(), key=lambda g: -len(g[0]))  # similar lengths share a batch: little padding
        requests_per_forward = int(override_bs or self.batch_size) if str(self.batch_size).isdigit() else 16
        per_batch = QUESTIONS_PER_REQUEST * requests_per_forward
        chunk = CONTINUATIONS_PER_REQUEST * requests_per_forward
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                  desc="Running loglikelihood requests") as bar:
            for start in range(0, len(ordered), per_batch):
                batch = ordered[start:start + per_batch]
                scored = self._score([c for c, _ in batch], [[requests[i][2] for i in m] for _, m in batch], chunk)
                for (_, members), group in zip(batch, scored, strict=True):
                    for i, answer in zip(members, group, strict=True):
                        answers[i] = answer
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                    bar.update(len(members))
        return answers  # type: ignore[return-value]

    @torch.no_grad()
    def _score(self, contexts: list[tuple[int, ...]], continuations: list[list[list[int]]], chunk: int
               ) -> list[list[tuple[float, bool]]]:
        """For each context, each of its continuations' log-probability and whether greedy decoding gives it."""
        device, lengths = self.device, [len(c) for c in contexts]
        width = max(lengths)
        ids = torch.tensor([list(c) + [c[0]] * (width - len(c)) for c in contexts], device=device)
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], device=device)
        # the decoder's states, then the output head at each context's last position only
        out = self.model.model(input_ids=ids, attention_mask=mask, use_cache=True)
        last = torch.tensor(lengths, device=device) - 1
        ends = out.last_hidden_state[torch.arange(len(contexts), device=device), last]
        first = F.log_softmax(self.model.lm_head(ends), dim=-1, dtype=self.softmax_dtype)
        rows = [g for g, conts in enumerate(continuations) for _ in conts]
        flat = [c for conts in continuations for c in conts]
        rest: dict[int, torch.Tensor] = {}  # row -> log-probabilities after its continuation's tokens but the last
        longer = sorted((r for r, c in enumerate(flat) if len(c) > 1), key=lambda r: len(flat[r]))
        for start in range(0, len(longer), chunk):  # rows of similar lengths together: little padding
            part = longer[start:start + chunk]
            logp = self._continue(out.past_key_values, mask, lengths, [rows[r] for r in part], [flat[r] for r in part])
            rest.update({r: logp[k, :len(flat[r]) - 1] for k, r in enumerate(part)})
        answers: list[list[tuple[float, bool]]] = [[] for _ in contexts]
        for r, (g, cont) in enumerate(zip(rows, flat, strict=True)):
            head = first[g][None]
            logp = torch.cat([head, rest[r]]) if r in rest else head
            target = torch.tensor(cont, device=logp.device)
            greedy = bool((logp.argmax(dim=-1) == target).all())
            answers[g].append((float(logp.gather(1, target[:, None]).sum()), greedy))
        return answers

    def _continue(self, context_cache, mask: torch.Tensor, lengths: list[int], groups: list[int],
                  continuations: list[list[int]]) -> torch.Tensor:
        """Log-probabilities after every continuation token but the last, each continuation on a copy of its own
        context's cache."""
        device, longest = self.device, max(len(c) for c in continuations)
        cache = copy.deepcopy(context_cache)
        cache.batch_select_indices(torch.tensor(groups, device=device))
        ids = torch.tensor([c[:-1] + [c[0]] * (longest - len(c)) for c in continuations], device=device)
        positions = torch.tensor([[lengths[g] + j for j in range(longest - 1)] for g in groups], device=device)
        full = torch.cat([mask[groups], torch.ones_like(ids)], dim=1)
        logits = self.model(ids, attention_mask=full, position_ids=positions, past_key_values=cache).logits
        return F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
