"""The commands' parsers, one module per family of :mod:`qsync_opt.cli` (``info``,
``model``, ``planning``, ``netsim``, ``report``, ``train``, ``sweep``, ``profile``,
``demo``). Each registers its commands' flags, help and default ``fn``: a
:class:`~qsync_opt.cli.args.Deferred` naming the body in :mod:`qsync_opt.cli`, imported only
when that command runs. A parser module imports only what its flags need (their types,
limits and help), so ``qsync-opt --help`` imports neither torch nor the solve pipeline."""
