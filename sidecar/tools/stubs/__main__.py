"""``python -m sidecar.stubs``: run one stub engine (see ``sidecar.stubs.cli``)."""

from sidecar.stubs.cli import main

raise SystemExit(main())
