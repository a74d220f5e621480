"""Where the experts of a mixture-of-experts model live in an expert-parallel group (pure: no torch, no I/O).

`expert_map` is the data: an epoch's expert location map (which logical expert each physical slot of each present
rank holds), its shape (experts, group size, slots per rank), its JSON form and the checks on a map received from
outside. `full_layout` computes the layout of a whole group from its shape alone, `placement` plans an epoch (the
full layout, or the previous map repaired for the ranks present) and `changes` says what each rank must load or may
drop to go from one map to the next. `routing` picks the copy of an expert that serves a token.
"""
