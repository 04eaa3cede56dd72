"""The offline loop (DPO, IPO, KTO, SFT, reward models) and what it trains with: objectives,
batches, tokenized data and the reference log-probs."""
