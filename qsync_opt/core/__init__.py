"""The foundation every layer reads: precisions, errors, units, limits, device names, this host, progress."""
