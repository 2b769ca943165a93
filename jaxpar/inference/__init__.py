"""Generation: sampling rules (``sampling``), KV-cached decoding (``decoding``), and
speculative decoding's rounds (``speculative``) and CaPE token trees (``token_tree``)."""
