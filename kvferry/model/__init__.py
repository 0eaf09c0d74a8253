"""The reference NemotronH model run through kvferry's pools: weights, drafter, tokenizer, tensor parallelism, attention and Mamba2 maths."""
