"""A step's batch as plain data: what the leader decides and any rank can execute (pure, no torch).

Keeping the plan free of tensors and of Sequence objects is what lets a follower rank of a group receive the
same plan over the wire later and run the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.worker.engine.scheduler import SchedulerOutput
from tidal.worker.engine.sequence import UNKNOWN_TOKEN


@dataclass(frozen=True)
class StepPlan:
    seq_ids: list[int]  # [B] the scheduled sequences, in batch order
    input_ids: list[int]  # [T] new tokens of all sequences, packed
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T] cache slot (block_id * block_size + offset) each new token's K/V goes to
    cu_seqlens_q: list[int]  # [B + 1] where each sequence's new tokens start in the packed batch
    seq_lens: list[int]  # [B] context length after this step (cached + new)
    block_tables: list[list[int]]  # [B][*] blocks of each sequence
    sample_indices: list[int]  # [S] rows of the packed batch whose logits are sampled
    sample_seq_ids: list[int]  # [S] the sequence each sampled row belongs to
    # Async scheduling: input tokens the previous step samples and the host has not read yet (UNKNOWN_TOKEN in
    # input_ids). The runner takes input_ids[unknown_rows[i]] from the previous step's sampled tokens, row
    # unknown_sources[i], on the device.
    unknown_rows: list[int] = field(default_factory=list)  # [U] rows of input_ids
    unknown_sources: list[int] = field(default_factory=list)  # [U] rows of the previous step's sampled tokens
    # Prompt logprobs: rows of the packed batch whose logits score the prompt's next token (only sequences that ask;
    # chunk by chunk as the prefill goes), that token, and (seq_id, the token's position in its prompt).
    prompt_logit_rows: list[int] = field(default_factory=list)  # [P]
    prompt_logit_targets: list[int] = field(default_factory=list)  # [P]
    prompt_logit_positions: list[tuple[int, int]] = field(default_factory=list)  # [P]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_ids)


def build_step_plan(out: SchedulerOutput, block_size: int, sample_rows: dict[int, int] | None = None) -> StepPlan:
    """`sample_rows`: seq_id -> row among the previous step's sampled tokens, for the sequences whose last token
    that step samples (unknown until read); a sequence's other tokens are all known."""
    seq_ids: list[int] = []
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q = [0]
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_indices: list[int] = []
    sample_seq_ids: list[int] = []
    unknown_rows: list[int] = []
    unknown_sources: list[int] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_positions: list[tuple[int, int]] = []
    num_tokens = 0
    for item in out.scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        num_new = item.num_new_tokens
        end = start + num_new
        table = seq.block_table
        token_ids = seq.token_ids
        seq_ids.append(seq.seq_id)
        if num_new == 1:  # a decode step: spare the ranges and generators below
            input_ids.append(token_ids[start])
            positions.append(start)
            slot_mapping.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        # A position scores the prompt token after it; only a prefill chunk has such positions (cheap test first).
        if start < len(seq.prompt_token_ids) - 1 and seq.params.needs_prompt_logits and seq.sample_index == 0:
            last = min(end, len(seq.prompt_token_ids) - 1)  # positions start..last-1 score tokens start+1..last
            prompt_rows.extend(range(num_tokens, num_tokens + last - start))
            prompt_targets.extend(seq.prompt_token_ids[start + 1 : last + 1])
            prompt_positions.extend((seq.seq_id, p) for p in range(start + 1, last + 1))
        num_tokens += num_new
        if end == len(token_ids) and token_ids[-1] == UNKNOWN_TOKEN:
            if sample_rows is None or seq.seq_id not in sample_rows:
                raise RuntimeError(f"sequence {seq.seq_id}'s last token is unknown and no step samples it")
            unknown_rows.append(num_tokens - 1)
            unknown_sources.append(sample_rows[seq.seq_id])
        cu_seqlens_q.append(num_tokens)
        seq_lens.append(end)
        block_tables.append(table[:])  # a copy: the plan must not change when the sequence grows later
        if item.will_sample:
            sample_indices.append(num_tokens - 1)
            sample_seq_ids.append(seq.seq_id)
    return StepPlan(
        seq_ids=seq_ids,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_indices=sample_indices,
        sample_seq_ids=sample_seq_ids,
        unknown_rows=unknown_rows,
        unknown_sources=unknown_sources,
        prompt_logit_rows=prompt_rows,
        prompt_logit_targets=prompt_targets,
        prompt_logit_positions=prompt_positions,
    )


def padded_block_tables(block_tables: list[list[int]], width: int) -> list[int]:
    """The tables as one row-major [B * width] list, each row padded with block 0 (padding is never read)."""
    flat: list[int] = []
    extend = flat.extend
    padding = [0] * width
    for table in block_tables:
        extend(table)
        extend(padding[len(table) :])
    return flat
