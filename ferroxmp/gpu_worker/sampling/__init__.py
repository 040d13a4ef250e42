"""Choosing tokens from logits: the sampler (`sampler`), grammar masks (`grammar`, compiled
off the step loop by `grammar_prep`) and the drafters of speculation: prompt lookup
(`ngram`) and a draft model (`draft_model`)."""
