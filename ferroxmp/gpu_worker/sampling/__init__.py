"""Choosing tokens from logits: the sampler (`sampler`), grammar masks (`grammar`, compiled
off the step loop by `grammar_prep`) and prompt-lookup drafts for speculation (`ngram`)."""
