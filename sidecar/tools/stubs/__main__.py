"""``python -m sidecar.tools.stubs``: run one stub engine (see ``sidecar.tools.stubs.cli``)."""

from sidecar.tools.stubs.cli import main

raise SystemExit(main())
