"""The model's entry points for the operations parallelism changes: attention
(``attention.dot_product_attention``: XLA, the ring, or a fused kernel), projections
(``linear.dense``: XLA or SUMMA), and the per-device kernel calls behind them
(``kernel_ops``: flash/decode attention, norms, the fused loss under ``shard_map``)."""
