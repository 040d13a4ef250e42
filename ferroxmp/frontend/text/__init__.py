"""Text at the edge: the tokenizer (`tokenizer`), prompts and chat templates (`prompts`),
incremental detokenization and stop strings (`detokenizer`), reasoning splitting
(`reasoning`)."""
