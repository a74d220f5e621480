"""Turning logits into next tokens, for a whole batch at once on the device.

The order, per row: logit edits (logit_bias, min_tokens' bans) -> penalties (repetition, then frequency and
presence) -> the grammar's mask (structured outputs: disallowed tokens to -inf) -> greedy argmax, or temperature ->
min-p, top-k, top-p -> a draw. Each stage runs only when some row of the batch uses it, and then over the rows that
do, with the rows' parameters as tensors: a batch that mixes them with plain requests is still one pass, and a batch
of plain greedy rows is one argmax as before.

Logprobs (`sample_with_logprobs`), only for the rows that ask (`SampleBatch.logprob_rows`; None, the usual case,
costs nothing): mode "raw" takes a log_softmax of the model's logits before any edit; mode "processed" takes it of
the distribution the row is drawn from, next to the choice (`_choose`): after edits, penalties and the grammar's
mask, and for a random row after temperature and truncation (a greedy row's processed logits are not scaled).

The logits come in the model's dtype (bf16 for most models). A batch of plain rows never widens them: greedy rows
take the argmax of the bf16 values (the same token as over their exact fp32 widening), random rows widen only their
own rows. Edits, penalties, grammar masks and logprobs work on an fp32 copy of the whole batch, made only in the
steps that use them: at batch 256 and a 128k vocabulary that copy costs ~100 us on an H100.

Random rows use the "exponential race" (argmax of probs / Exp(1) noise, which draws from `probs`) so each
seeded request draws its noise from its own generator: its tokens don't depend on what else is in the batch.

`sample_on_device` never waits for the device: every small host list goes over as one pinned, asynchronous copy,
and rows are picked and replaced with index_select/index_copy_. The engine launches the next step before it reads
this one's tokens, so a wait here would also wait for the forward just queued.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.worker.engine.grammar_masks import DEFAULT_LIMIT_S, GrammarMasks
from tidal.worker.engine.host_tensors import float32_tensor, int64_tensor, to_device
from tidal.worker.engine.logit_edits import LogitEdits
from tidal.worker.engine.logprobs import DeviceLogprobs
from tidal.worker.engine.penalties import Penalties
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.truncation import truncate


class Sampler:
    def __init__(
        self,
        device: torch.device,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        grammar_mask_limit_s: float = DEFAULT_LIMIT_S,
    ) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)  # requests without a seed
        self._per_request: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded request
        self._edits = LogitEdits(device, eos_token_ids)
        self._penalties = Penalties(device)
        self._grammars = GrammarMasks(device, grammar_mask_limit_s)

    def forget(self, seq_id: int) -> None:
        self._per_request.pop(seq_id, None)
        self._edits.forget(seq_id)
        self._penalties.forget(seq_id)

    def prepare_masks(self, matchers: list[Any], vocab_size: int) -> None:
        """Start computing the grammar masks of the next sampling's rows (see GrammarMasks.prepare)."""
        self._grammars.prepare(matchers, vocab_size)

    def discard_prepared_masks(self) -> None:
        self._grammars.discard()

    def take_slow_masks(self) -> list[tuple[Any, float]]:
        """The grammar matchers whose mask took longer than the limit since the last call, and how long (see
        GrammarMasks.take_slow): the engine ends their requests."""
        return self._grammars.take_slow()

    def close(self) -> None:
        """End the grammar masks' fill thread (the engine is shutting down)."""
        self._grammars.close()

    def sample(self, logits: torch.Tensor, batch: SampleBatch) -> list[int]:
        """logits [S, V] (fp32 or the model's dtype) -> S token ids (waits for them)."""
        return self.sample_on_device(logits, batch).tolist()

    # Under inference mode, as the logits are made: the device state kept across steps (histories, edits) is then
    # made and updated the same way.
    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        """logits [S, V] (fp32 ones are edited in place) -> token ids [S] int64 on logits' device, queued without
        waiting for the device."""
        return self.sample_with_logprobs(logits, batch)[0]

    @torch.inference_mode()
    def sample_with_logprobs(
        self, logits: torch.Tensor, batch: SampleBatch
    ) -> tuple[torch.Tensor, DeviceLogprobs | None]:
        """As `sample_on_device`, and the logprobs of `batch.logprob_rows` (in that order), also queued only."""
        lp_rows = batch.logprob_rows
        has_edits = has_penalties = False
        if batch.has_control_columns:
            for params in batch.params:
                has_edits |= params.has_logit_edits
                has_penalties |= params.has_penalties
        # Every stage past the choice needs the whole batch in fp32: a copy for bf16 logits (a no-op for fp32).
        if lp_rows or batch.matchers is not None or has_edits or has_penalties:
            logits = logits.float()
        raw = None
        if lp_rows:
            raw_rows = [i for i in lp_rows if batch.params[i].logprobs_mode == "raw"]
            if raw_rows:  # before the edits below change the logits in place
                raw = logits.index_select(0, to_device(int64_tensor(raw_rows), logits.device)).log_softmax(dim=-1)
        penalised = None
        if batch.has_control_columns:
            logits = logits.contiguous()  # the edits write through a flat view (a no-op for a linear's output)
            if has_edits:
                self._edits.apply(logits, batch)
            if has_penalties:
                penalised = self._penalties.apply(logits, batch)
        if batch.matchers is not None:
            # Last before the choice: whatever the edits and penalties did, a token the grammar forbids cannot be
            # drawn (a positive logit_bias added after the mask would otherwise revive it).
            self._grammars.apply(logits, batch)
        else:
            self._grammars.discard()  # masks prepared for structured rows that have all ended since
        tokens, scaled, random_rows = self._choose(logits, batch)
        if penalised is not None:
            self._penalties.record(penalised, tokens)
        if not lp_rows:
            return tokens, None
        return tokens, self._logprobs(logits, tokens, batch, raw, scaled, random_rows)

    def _logprobs(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        batch: SampleBatch,
        raw: torch.Tensor | None,
        scaled: torch.Tensor | None,
        random_rows: list[int],
    ) -> DeviceLogprobs:
        """The logprob rows' records: raw ones from `raw` (in their order), processed ones from the logits as
        edited and penalised, a random row's from `scaled` (its row among `random_rows`)."""
        device = logits.device
        lp_rows = batch.logprob_rows or []
        params = batch.params
        processed = [i for i in lp_rows if params[i].logprobs_mode == "processed"]
        parts = [] if raw is None else [raw]
        if processed:
            proc = logits.index_select(0, to_device(int64_tensor(processed), device))  # [P, V]
            random_at = {row: r for r, row in enumerate(random_rows)}
            from_scaled = [(p, random_at[i]) for p, i in enumerate(processed) if i in random_at]
            if from_scaled and scaled is not None:
                pairs = to_device(int64_tensor([x for pair in from_scaled for x in pair]), device).view(-1, 2)
                proc.index_copy_(0, pairs[:, 0], scaled.index_select(0, pairs[:, 1]))
            parts.append(proc.log_softmax(dim=-1))
        order = [i for i in lp_rows if params[i].logprobs_mode == "raw"] + processed
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)  # [L, V] rows in `order`
        if order != lp_rows:  # back to the batch's order
            position = {row: j for j, row in enumerate(order)}
            stacked = stacked.index_select(0, to_device(int64_tensor([position[i] for i in lp_rows]), device))
        chosen = tokens.index_select(0, to_device(int64_tensor(lp_rows), device))
        return DeviceLogprobs(stacked, chosen, [params[i].logprobs or 0 for i in lp_rows])

    def _choose(self, logits: torch.Tensor, batch: SampleBatch) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """-> the tokens [S], and for the random rows (listed) the logits they were drawn from [R, V]."""
        greedy = logits.argmax(dim=-1)  # [S]
        all_params = batch.params
        random_rows = [i for i, p in enumerate(all_params) if not p.is_greedy]
        if not random_rows:
            return greedy, None, random_rows
        device = logits.device
        sub = [all_params[i] for i in random_rows]
        num = len(random_rows)
        truncates = any(p.truncates for p in sub)
        floats = [p.temperature for p in sub]
        if truncates:
            floats += [p.top_p for p in sub] + [p.min_p for p in sub]
        floats_t = to_device(float32_tensor(floats), device)
        vocab = logits.shape[1]
        ints = random_rows + ([p.top_k if p.top_k != -1 else vocab for p in sub] if truncates else [])
        ints_t = to_device(int64_tensor(ints), device)
        rows_t = ints_t[:num]  # [R]
        scaled = logits.index_select(0, rows_t).float() / floats_t[:num, None]  # [R, V] fp32
        if truncates:
            sort = any(p.top_k != -1 or p.top_p < 1.0 for p in sub)
            scaled = truncate(scaled, ints_t[num:], floats_t[num : 2 * num], floats_t[2 * num :], sort)
        probs = scaled.softmax(dim=-1)  # [R, V]
        noise = torch.empty_like(probs)
        shared_rows = []
        for r, i in enumerate(random_rows):
            seed = all_params[i].seed
            if seed is None:
                shared_rows.append(r)
                continue
            seq_id = batch.seq_ids[i]
            gen = self._per_request.get(seq_id)
            if gen is None:
                gen = self._per_request[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
            noise[r].exponential_(generator=gen)
        if shared_rows:
            shared = torch.empty((len(shared_rows), probs.shape[1]), device=device).exponential_(
                generator=self._shared
            )  # [R_shared, V]
            noise.index_copy_(0, to_device(int64_tensor(shared_rows), device), shared)
        sampled = (probs / noise).argmax(dim=-1)  # [R]
        return greedy.index_copy_(0, rows_t, sampled), scaled, random_rows
