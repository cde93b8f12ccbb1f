"""``python -m qsync_opt.cli``: the ``qsync-opt`` command."""

from __future__ import annotations

from . import main

raise SystemExit(main())
