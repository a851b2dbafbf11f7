"""Developer tools run outside training: offline makers of small artifacts for tests,
examples and the docs (`tiny_llm`: model, tokenizer, instruction data; nothing is
downloaded) and checks of the platform's models against real runs."""
