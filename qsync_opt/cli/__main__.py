"""``python -m qsync_opt.cli``: the ``qsync-opt`` command."""

from __future__ import annotations

from qsync_opt.cli import main

raise SystemExit(main())
