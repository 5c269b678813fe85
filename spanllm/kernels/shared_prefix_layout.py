"""The partial results of shared-prefix decode attention, as the two kernels exchange them (no Triton here: the
host planner, spanllm.attention.shared_prefix, checks its plans against these limits).

Stage 1 (spanllm.kernels.paged_attention._shared_prefix_kernel) writes, per decode row b, key split j < the row's
splits and query head h: m, l [B, MAX_PREFIX_SPLITS, hq] and acc [B, MAX_PREFIX_SPLITS, hq, head_dim], float32; the
decode kernel folds the row's first row_splits[b] of them into its own result. A split index >= MAX_PREFIX_SPLITS
would land in the next row's slots: the planner never makes one.
"""

MAX_PREFIX_SPLITS = 8
