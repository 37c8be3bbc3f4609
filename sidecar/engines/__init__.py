"""Everything that talks to an engine: the calls of a request's legs, the engines' health and
what they serve, the tokenizer."""
