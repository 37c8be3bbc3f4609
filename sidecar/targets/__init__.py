"""Prefill targets: which prefill engine a request's prefill leg may go to, and which it does.

    selector.py    the router's ``x-prefiller-host-port`` header parsed strictly, the static
                   pool, the allowlist check (resolved once, the checked address dialled)
    allowlist.py   the allowlist's entries (HOST:PORT, HOST:*, CIDR:PORT, CIDR:*)
    kubernetes.py  the allowlist kept current from a pod selector (LIST+WATCH)
    choice.py      the choice among several targets (fewest legs in flight, cool-downs)
"""
