"""Transport-agnostic protocol core: request checks, the rules common to every prefill leg,
and the context a hand-off is built from. Pure functions over dicts; no I/O."""
